"""bench/decode.py at its test size (--quick: T 8, 4 new tokens): every tiny config in both cache modes, and
its device-independent columns hold issue 51's goal (fixed_point's cache within 1.25x of tiny_attn's per
attention block; exact's no smaller)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow          # a child process that imports torch and builds every tiny config


def test_every_tiny_config_decodes_in_both_modes_and_fixed_point_is_a_plain_cache(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "bench/decode.py", "--quick", "--out", str(out)], cwd=ROOT, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ms_per_token" in proc.stdout
    rows = {(r["config"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    configs = {p.stem for p in (ROOT / "configs").glob("tiny_*.yaml")}
    assert set(rows) == {(c, m) for c in configs for m in ("exact", "fixed_point")}
    plain = rows["tiny_attn", "exact"]["per_block_kb"]
    for name in ("tiny_fpsa", "tiny_looped", "tiny_attractor"):
        assert rows[name, "fixed_point"]["per_block_kb"] <= 1.25 * plain, (name, rows[name, "fixed_point"], plain)
    for name in configs:
        assert rows[name, "fixed_point"]["cache_bytes"] <= rows[name, "exact"]["cache_bytes"], name
        assert rows[name, "exact"]["ms_per_token"] > 0


def test_agreement_of_the_two_modes_on_a_model(tmp_path):
    """bench/decode_agreement.py --quick on random weights: exact agrees with itself and scores the full
    forward's perplexity; fixed_point's rows are there with their agreement and iterations."""
    out = tmp_path / "agreement.json"
    cmd = [sys.executable, "bench/decode_agreement.py", "--config", "configs/tiny_mixed.yaml", "--quick",
           "--depths", "0", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(r["depth"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(d, m) for d in ("eval", 1) for m in ("exact", "fixed_point")}
    for depth in ("eval", 1):
        exact, fixed = rows[depth, "exact"], rows[depth, "fixed_point"]
        assert exact["max_logit_diff"] == 0 and exact["greedy_agree"] == 1
        assert abs(exact["ppl"] / exact["full_ppl"] - 1) < 1e-4          # exact decoding is the full forward
        assert 0 <= fixed["greedy_agree"] <= 1 and fixed["iters_per_token"] >= 1
    assert rows[1, "fixed_point"]["max_logit_diff"] > 0                  # at depth 1 the modes differ


def test_agreement_per_layer_type(tmp_path):
    """--only fpsa: fixed_point for the fpsa layer only, the others exact (one layer type's share of the
    difference); a type the model lacks is refused with its types."""
    out = tmp_path / "agreement.json"
    cmd = [sys.executable, "bench/decode_agreement.py", "--config", "configs/tiny_mixed.yaml", "--quick",
           "--depths", "1", "--out", str(out)]
    proc = subprocess.run(cmd + ["--only", "fpsa"], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["layers"]) for r in rows] == [("exact", "fpsa"), ("fixed_point", "fpsa")]
    assert rows[1]["max_logit_diff"] > 0 and rows[1]["iters_per_token"] >= 1
    bad = subprocess.run(cmd + ["--only", "attractor"], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert bad.returncode != 0 and "no such looped layer" in bad.stderr and "fpsa" in bad.stderr


def test_a_batch_with_compaction_computes_no_more_rows(tmp_path):
    """``--batch 4 --compact off on``: off computes batch x iterations rows per step; on no more, in both modes
    (fpscale.solvers.rows; that it computes fewer is tests/models/test_decode_rows.py's)."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "bench/decode.py", "--quick", "--batch", "4", "--compact", "off", "on", "--configs",
           "configs/tiny_attractor.yaml", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rows_per_step" in proc.stdout
    rows = {(r["mode"], r["compact"]): r for r in json.loads(out.read_text())["rows"]}
    for mode in ("exact", "fixed_point"):
        off, on = rows[mode, "off"], rows[mode, "on"]
        assert off["rows_per_step"] == pytest.approx(4 * off["iters_per_token"])
        assert on["rows_per_step"] <= off["rows_per_step"]


def test_the_static_and_compiled_steps_decode_as_the_eager_one(tmp_path):
    """``--steps eager static compiled compiled_static`` (dynamo's eager backend here: no C++ build): a row per
    step, the same solves (iterations per token) and the same caches (static ones are preallocated as dynamic
    ones are), ``--alloc``'s column; exact mode is refused for static steps."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "bench/decode.py", "--quick", "--batch", "2", "--modes", "fixed_point", "--steps",
           "eager", "static", "compiled", "compiled_static", "--backend", "eager", "--configs",
           "configs/tiny_looped.yaml", "--out", str(out)]
    proc = subprocess.run(cmd + ["--alloc"], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["step"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["alloc_mb_per_token"] > 0 for r in rows.values()) and "alloc_mb_per_token" in proc.stdout
    assert set(rows) == {"eager", "static", "compiled", "compiled_static"} and "step" in proc.stdout
    for step in ("static", "compiled", "compiled_static"):
        assert rows[step]["iters_per_token"] == rows["eager"]["iters_per_token"], rows
        assert rows[step]["cache_bytes"] == rows["eager"]["cache_bytes"], rows
        assert rows[step]["ms_per_token"] > 0
    bad = subprocess.run(cmd[:-2] + ["--modes", "exact"], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert bad.returncode != 0 and "--steps static and compiled_static take --modes fixed_point" in bad.stderr
