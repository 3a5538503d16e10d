"""bench/scan.py on CPU: the PyTorch scan is timed and its launches counted (the numbers behind the
dispatch's fallback warning, "about 400 kernel launches per scan call at T = 2048, about 1000 with
the backward"); the kernels that need a GPU say so rather than running. The launch count depends on
T alone, so the quick test runs T = 2048 at a tiny width; the slow one runs the bench's real
arguments (the 125m_fpmamba geometry), device aside."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def bench(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "bench/scan.py", "--device", "cpu", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=1800, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "selective scan at B=" in proc.stdout and "launches_fwd" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def check(report: dict) -> dict:
    rows = {r["scan"]: r for r in report["rows"]}
    assert list(rows) == ["pytorch", "triton", "mamba-ssm"]
    torch_row = rows["pytorch"]
    assert torch_row["fwd_ms"] > 0 and torch_row["fwd_bwd_ms"] > 0 and torch_row["x_pytorch"] == 1
    assert torch_row["saved_MiB"] > 0
    assert torch_row["fwd_GBs"] > 0 and torch_row["fwd_bwd_GBs"] > 0 and "fwd_of_peak" not in torch_row   # CPU
    assert report["peak_bandwidth_GBs"] is None
    assert 350 <= torch_row["launches_fwd"] <= 450, torch_row
    assert 900 <= torch_row["launches_fwd_bwd"] <= 1100, torch_row
    assert "needs a GPU" in rows["triton"]["note"] and "fwd_ms" not in rows["triton"], rows["triton"]
    mamba = rows["mamba-ssm"]                  # needs a GPU, or not installed, or fails to import
    assert mamba["note"] and "fwd_ms" not in mamba, mamba
    return torch_row


@pytest.mark.slow
def test_the_bench_counts_the_pytorch_scans_launches_at_t_2048(tmp_path):
    report = bench(tmp_path / "scan.json", "--B", "1", "--d-inner", "16", "--d-state", "4", "--repeats", "1")
    assert report["geometry"] == {"B": 1, "T": 2048, "d_inner": 16, "d_state": 4}
    check(report)


@pytest.mark.slow
def test_the_bench_at_the_125m_fpmamba_geometry(tmp_path):
    report = bench(tmp_path / "scan.json", "--repeats", "1")
    micro = yaml.safe_load((ROOT / "configs/125m_fpmamba.yaml").read_text())["train"]["micro_batch"]
    assert report["geometry"] == {"B": micro, "T": 2048, "d_inner": 1536, "d_state": 16}
    small = check(bench(tmp_path / "small.json", "--B", "1", "--d-inner", "16", "--d-state", "4", "--repeats", "1"))
    row = check(report)
    assert (row["launches_fwd"], row["launches_fwd_bwd"]) == (small["launches_fwd"], small["launches_fwd_bwd"])
