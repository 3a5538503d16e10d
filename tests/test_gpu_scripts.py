"""The GPU scripts' pipelines on CPU (their figures need a GPU): scripts/gpu_smoke.sh runs its whole
matrix, two CPU processes standing in for two GPUs, one line per run; bench/gpu.py prints its
tables and writes JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_gpu_smoke_matrix_runs_on_cpu(tmp_path):
    env = {**os.environ, "FPSCALE_SMOKE_CPU": "1", "FPSCALE_SMOKE_OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    runs = [line.split()[1] for line in lines]
    assert runs == ["tiny_mixed-1proc-flash", "tiny_mixed-1proc-sdpa", "125m_fpsa-1proc-flash", "125m_fpsa-1proc-sdpa",
                    "tiny_mixed-dp2-zero1", "tiny_mixed-dp2-zero3", "125m_fpsa-dp2-zero1", "125m_fpsa-dp2-zero3",
                    "125m_fpsa-tp2xdp1-zero1"], proc.stdout


@pytest.mark.slow
def test_gpu_bench_quick_writes_its_tables(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--quick", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["config"] for r in result["rows"]] == ["tiny_attn", "tiny_fpsa"]
    assert all(r["tokens_per_s"] > 0 and r["tflops_executed"] > 0 for r in result["rows"])
    assert result["rows"][1]["iters"] != "-"                                 # the fpsa layers' iterations
    assert [r["config"] for r in result["fit_rows"]] == ["tiny_fpsa"]        # the looped config's fit search
