"""The GPU scripts' pipelines on CPU (their figures need a GPU): scripts/gpu_smoke.sh runs its whole
matrix, two CPU processes standing in for two GPUs, one line per run; bench/gpu.py prints its
tables and writes JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpu_smoke_matrix_runs_on_cpu(tmp_path):
    """The whole matrix with the GPU runs' own arguments (configs, sequence, batch, bf16, layouts): only the
    device differs, and on CPU the flash=0 twin of each auto run (SDPA either way) is not run twice."""
    env = {**os.environ, "FPSCALE_SMOKE_CPU": "1", "FPSCALE_SMOKE_OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    runs = [line.split()[1] for line in lines if line.startswith(("ok ", "FAIL", "same "))]
    assert runs == ["tiny_mixed-1proc-auto", "tiny_mixed-1proc-sdpa", "125m_fpsa-1proc-auto", "125m_fpsa-1proc-sdpa",
                    "tiny_mixed-dp2-zero1", "tiny_mixed-dp2-zero3", "125m_fpsa-dp2-zero1", "125m_fpsa-dp2-zero3",
                    "125m_fpsa-tp2xdp1-zero1"], proc.stdout
    ran = [line for line in lines if line.strip().startswith("ran:")]
    assert len(ran) == 7, proc.stdout
    # bf16 autocast: q, k and v reach attention in bf16 (SDPA's flash backend would take them on a GPU)
    assert all("attention: sdpa bf16" in line for line in ran), proc.stdout
    assert "scan:" in ran[0], proc.stdout                    # tiny_mixed's fpmamba layer: the scan that ran
    config = (tmp_path / "125m_fpsa-dp2-zero1" / "config.yaml").read_text()
    assert "seq_len: 128" in config and "precision: bf16" in config and "d_model: 768" in config


@pytest.mark.slow
def test_gpu_bench_runs_its_gpu_command_on_cpu(tmp_path):
    """``bench/gpu.py --configs configs/125m_fpsa.yaml`` as on a GPU: no FineWeb shards here, so synthetic tokens
    of the recipe's geometry (seq 2048, vocab 50304, bf16), and it says so; the kernels that ran are counted."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--configs", "configs/125m_fpsa.yaml", "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "125m_fpsa: synthetic tokens (no prepared token shards in cache/fineweb/tokens" in proc.stdout
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["config"] == "125m_fpsa" and row["data"] == "synthetic" and row["micro"] == 1
    assert row["tokens_per_s"] > 0 and row["tflops_executed"] > 0 and row["peak_gib"] > 0
    assert row["attention"] == "sdpa bf16" and row["iters"].startswith("6:")     # the fpsa layers' iterations
    assert result["fit_rows"] == [{"config": "125m_fpsa", "iterations": 16, "max_micro_implicit": "needs a GPU",
                                   "max_micro_unroll": "needs a GPU"}]
