"""Kernel tests under Triton's interpreter: a test file's ``test_kernel_*`` tests, those matching a
marker expression, rerun in a child with ``TRITON_INTERPRET=1`` (the interpreter must be set before
Triton is imported, hence the child). Every selected test must run and pass: a skip is a failure."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_kernel_tests_interpreted(test_file: str, marker: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marker,
           "-k", "test_kernel_", str(Path(test_file).resolve().relative_to(ROOT))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    print(out)
    assert proc.returncode == 0, out
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, out
