"""bench/profile_step.py on CPU at small width (what CI runs): the trainer's own step profiled, every
category's share, kernels and host syncs per step, graph breaks; and fpscale.profiling.count_syncs
(the dispatch mode behind the host-sync count) on reads it must see and work it must not count."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fpscale.profiling import count_syncs

ROOT = Path(__file__).resolve().parents[1]


def profile(tmp_path: Path, config: str, *extra: str) -> dict:
    out, trace = tmp_path / "p.json", tmp_path / "p.trace.json"
    cmd = [sys.executable, "bench/profile_step.py", "--config", f"configs/{config}.yaml", "--small", "--json",
           str(out), "--trace", str(trace), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=600, capture_output=True, text=True,
                          env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "kernels a step" in proc.stdout and "category" in proc.stdout, proc.stdout
    assert json.loads(trace.read_text())["traceEvents"]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_profile_of_an_attention_step_on_cpu(tmp_path):
    rec = profile(tmp_path, "125m_attn", "model.layers.0.repeat=2", "--fused-adamw")
    assert rec["device"] == "cpu" and rec["d_model"] == 64
    assert abs(sum(rec["shares"].values()) - 1) < 1e-6
    for cat in ("matmul", "attention", "loss_head", "optimizer", "norm", "elementwise"):
        assert rec["shares"][cat] > 0, (cat, rec["shares"])
    assert rec["shares"]["scan"] == 0 and rec["shares"]["solver"] == 0
    assert rec["kernels_per_step"] > 50 and rec["top_kernels"]
    assert rec["graph_breaks"] == 0 and rec["recompiles"] == 0
    assert rec["compile"] == "none"                  # auto on CPU
    assert rec["host_syncs_by_kind"] == {"Tensor.tolist": 1}       # CUDA's fused AdamW: loss and norm, one read


@pytest.mark.slow
def test_profile_of_an_fpmamba_step_finds_the_scan_and_the_solver(tmp_path):
    rec = profile(tmp_path, "125m_fpmamba", "model.layers.0.repeat=2")
    assert rec["shares"]["scan"] > 0 and rec["shares"]["solver"] > 0, rec["shares"]


def test_count_syncs_sees_value_reads_and_copies_not_compute():
    x = torch.randn(8)
    with count_syncs() as none:
        y = (x * 2).sum() + x.mean()
        _ = y + 1
    assert none.total == 0
    with count_syncs() as syncs:
        y.item()
        float(y)
        bool(y > 0)
        y.tolist()                # one read, though tolist may read element by element
        y.cpu()                   # a no-op on CPU, a device-to-host copy on a GPU: counted
        torch.ops.aten._local_scalar_dense(y)     # the op under .item(), called directly
        torch.nonzero(x > 0)      # the output's size depends on the values
    assert syncs.by_kind == {"Tensor.item": 1, "Tensor.__float__": 1, "Tensor.__bool__": 1, "Tensor.tolist": 1,
                             "Tensor.cpu": 1, "aten._local_scalar_dense": 1, "aten.nonzero": 1}, syncs.by_kind
    assert torch.Tensor.item is not None and "counted" not in torch.Tensor.item.__qualname__    # unpatched after
