"""bench/layers.py at a tiny size on CPU: it runs every section, and its device-independent
columns hold issue 15's goal (the implicit backward saves at most 1.05x one application of f) and
follow the solves (the inference FLOPs rise with the iterations a tighter tolerance takes)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every test reads bench/layers.py's report, a child process (imports torch: seconds): the full suite,
# not the quick loop
pytestmark = pytest.mark.slow


def bench(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "bench/layers.py", "--device", "cpu", "--d", "32", "--heads", "2", "--T", "16", "--B", "2",
           "--repeats", "1", "--hqsa-T", "16", "--dtypes", "fp32", "--threads", "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return bench(tmp_path_factory.mktemp("bench") / "layers.json")


def test_implicit_backward_saves_one_application_of_f(report):
    rows = {(r["layer"], r["backward"]): r for r in report["micro_batch_rows"]}
    for kind in ("fpsa", "fpmamba", "looped"):
        implicit, unroll = rows[kind, "implicit"], rows[kind, "unroll"]
        assert implicit["saved_x_one_f"] <= 1.05, (kind, implicit)
        assert implicit["max_micro_batch"] > unroll["max_micro_batch"], kind


def test_inference_flops_follow_the_iterations_taken(report, tmp_path):
    loose = {r["layer"]: r for r in report["inference_rows"]}
    assert set(loose) == {r["layer"] for r in report["layer_rows"]}
    tighter = bench(tmp_path / "tight.json", "--tol", "1e-5", "--max-iter", "12")
    tight = {r["layer"]: r for r in tighter["inference_rows"]}
    for kind in ("fpsa", "looped"):
        assert tight[kind]["iters"] > loose[kind]["iters"], kind
        assert tight[kind]["flops_x_attn"] > loose[kind]["flops_x_attn"], kind
    for rows in (loose, tight):
        assert rows["attn"]["MFLOP_per_token"] == pytest.approx(tight["attn"]["MFLOP_per_token"])
        assert all(r["us_per_token"] > 0 and r["latency_x_attn"] > 0 for r in rows.values())


def test_the_kernels_each_block_ran_are_named(report):
    """Counted at the call: on CPU attention is SDPA with q, k and v in fp32, FP-Mamba's scan the PyTorch one;
    epsilon's HQSA and the plain MLP-free blocks name only what they called."""
    ran = {r["layer"]: r["kernels_fp32"] for r in report["layer_rows"]}
    for kind in ("attn", "fpsa", "looped"):
        assert ran[kind].startswith("attention: sdpa fp32 x"), ran
    for kind in ("fpmamba", "mamba"):
        assert ran[kind].startswith("scan: pytorch x"), ran
