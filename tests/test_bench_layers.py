"""bench/layers.py at a tiny size: it runs every section, and its device-independent columns hold
issue 15's goals (implicit backward saves at most 1.05x one application of f) and seed 000's FLOP
accounting (fpsa's forward FLOPs follow its iterations)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fpscale.models import ModelConfig, layer_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "layers.json"
    cmd = [sys.executable, "bench/layers.py", "--d", "32", "--heads", "2", "--T", "16", "--B", "2",
           "--repeats", "1", "--hqsa-T", "16", "--dtypes", "fp32", "--threads", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=120, capture_output=True)
    return json.loads(out.read_text())


def test_implicit_backward_saves_one_application_of_f(report):
    rows = {(r["layer"], r["backward"]): r for r in report["micro_batch_rows"]}
    for kind in ("fpsa", "fpmamba", "looped"):
        implicit, unroll = rows[kind, "implicit"], rows[kind, "unroll"]
        assert implicit["saved_x_one_f"] <= 1.05, (kind, implicit)
        assert implicit["max_micro_batch"] > unroll["max_micro_batch"], kind


def test_inference_rows_count_forward_flops_at_the_iterations_taken(report):
    rows = {r["layer"]: r for r in report["inference_rows"]}
    assert set(rows) == {r["layer"] for r in report["layer_rows"]}
    assert rows["attn"]["flops_x_attn"] == 1.0 and rows["attn"]["iters"] == 1
    fpsa = rows["fpsa"]
    cfg = ModelConfig(vocab_size=16, d_model=32, n_heads=2, max_seq_len=16, layers=[layer_spec("fpsa")])
    static, per_iter = cfg.layers[0].flops(cfg, 16)
    assert fpsa["iters"] >= 1
    assert fpsa["MFLOP_per_token"] * 1e6 == pytest.approx(static + per_iter * fpsa["iters"])
    assert all(r["us_per_token"] > 0 and r["latency_x_attn"] > 0 for r in rows.values())
