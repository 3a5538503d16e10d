"""scripts/setup.sh fails loudly: a pip install that fails stops the set-up with the failing
command, pip's own error, and pip's exit status (it used to be swallowed, then exit 1 in silence)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_setup_with_a_broken_requirement_exits_nonzero_and_prints_the_pip_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("setup.sh", "torch_check.py"):
        shutil.copy(os.path.join(ROOT, "scripts", script), repo / "scripts")
    shutil.copytree(os.path.join(ROOT, "fpscale"), repo / "fpscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "README.md"), repo)
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    broken = pyproject.replace('"numpy>=1.24",', '"numpy==0.0.0.1",')      # no such release
    assert broken != pyproject
    (repo / "pyproject.toml").write_text(broken)
    # the project's environment, so that torch and DeepSpeed are there; pip fails while resolving,
    # before it changes anything in it
    os.symlink(os.path.join(ROOT, ".venv"), repo / ".venv")
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIP_RETRIES": "0", "PIP_TIMEOUT": "30"})
    assert proc.returncode != 0
    assert "[setup] FAILED" in proc.stderr and "pip" in proc.stderr and "install" in proc.stderr, proc.stderr
    assert "numpy==0.0.0.1" in proc.stderr, proc.stderr               # pip's own words on what failed
    assert "[setup] ready" not in proc.stdout


# scripts/torch_check.py: which torch the set-up installs, and whether the driver can run it
def torch_check():
    import importlib.util
    spec = importlib.util.spec_from_file_location("torch_check", os.path.join(ROOT, "scripts", "torch_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CPU_TORCH = {"version": "2.13.0+cpu", "cuda": None, "available": False, "device": None}
CUDA_TORCH = {"version": "2.13.0", "cuda": "12.8", "available": True, "device": "NVIDIA H100 80GB HBM3"}


@pytest.mark.parametrize("installed, gpu, wanted, install", [
    (None, False, None, "2.13.0"),                   # a fresh CPU machine: the release the project pins
    (None, True, None, "2.13.0"),                    # a fresh GPU machine: the same release, PyPI's CUDA build
    (None, True, "2.12.0", "2.12.0"),
    (CPU_TORCH, False, None, None),                  # set up already: kept
    (CPU_TORCH, False, "2.13.0", None),              # the release asked for is there
    (CPU_TORCH, False, "2.12.0", "2.12.0"),          # FPSCALE_TORCH replaces a CPU torch of another release
    (CPU_TORCH, True, None, "2.13.0"),               # a CPU build on a GPU machine is replaced
    (CPU_TORCH, True, "2.13.0", "2.13.0"),
    (CUDA_TORCH, True, None, None),                  # a CUDA torch is left alone
    (CUDA_TORCH, True, "2.13.0+cu126", "2.13.0+cu126"),
])
def test_which_torch_the_set_up_installs(installed, gpu, wanted, install):
    version, why = torch_check().plan(installed, gpu, wanted)
    assert version == install, why


@pytest.mark.parametrize("torch_cuda, driver, available, ok, says", [
    ("12.8", "13.0", True, True, ""),
    ("12.8", "12.8", True, True, ""),
    ("12.8", "12.4", True, True, "minor-version compatibility"),
    ("13.0", "12.8", False, False, "update the driver, or install a torch release built for CUDA 12.x"),
    (None, "12.8", False, False, "CPU build"),
    ("12.8", "12.8", False, False, "torch sees no GPU"),
])
def test_the_driver_check(torch_cuda, driver, available, ok, says):
    verdict, note = torch_check().driver_verdict(torch_cuda, driver, available)
    assert verdict == ok and says in note


@pytest.mark.slow
def test_the_driver_check_reads_nvidia_smi(tmp_path):
    """A stand-in nvidia-smi on PATH: one GPU, a driver for CUDA 12.4; this machine's CPU torch cannot run on it."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\nif [ "$1" = -L ]; then echo "GPU 0: NVIDIA H100 PCIe (UUID: GPU-1)"; '
                    'else echo "| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |"; fi\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    script = os.path.join(ROOT, "scripts", "torch_check.py")
    import sys
    proc = subprocess.run([sys.executable, script, "driver"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 GPU(s), GPU 0: NVIDIA H100 PCIe" in proc.stdout and "driver supports CUDA 12.4" in proc.stdout
    assert "CPU build" in proc.stdout
    plan = subprocess.run([sys.executable, script, "plan"], env=env, capture_output=True, text=True, timeout=120)
    assert plan.stdout.startswith("install torch==2.13.0: a GPU is present but torch 2.13.0+cpu is a CPU build")
    no_gpu = subprocess.run([sys.executable, script, "driver"], capture_output=True, text=True, timeout=120)
    assert no_gpu.returncode == 0 and no_gpu.stdout.startswith("no GPU"), no_gpu.stdout


@pytest.mark.slow
def test_deepspeeds_built_ops_stay_in_this_environment():
    """Importing fpscale points TORCH_EXTENSIONS_DIR into the environment (sys.prefix), unless it is set:
    two environments on one machine never share, and so never rebuild, DeepSpeed's JIT-built ops."""
    import sys
    code = "import os, sys, fpscale; print(os.environ['TORCH_EXTENSIONS_DIR']); print(sys.prefix)"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT).stdout.split()
    assert out[0] == os.path.join(out[1], "torch_extensions")
    mine = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_EXTENSIONS_DIR": "/tmp/mine"},
                          capture_output=True, text=True, timeout=300, cwd=ROOT).stdout.split()
    assert mine[0] == "/tmp/mine"
