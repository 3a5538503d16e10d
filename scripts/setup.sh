#!/usr/bin/env bash
# Set up a fresh machine for fpscale: a virtual environment in .venv with torch installed first (the
# CPU wheel on a machine without a GPU, so nothing pulls CUDA packages; PyPI's CUDA build where
# nvidia-smi lists a GPU, checked against the driver), DeepSpeed built against it, and fpscale; then
# one line on which kernels each layer type will run. Everything comes from the package registry.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh   (FPSCALE_TORCH=<release> to choose torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# run a set-up command quietly (only its "[setup]" lines show); if it fails, print the command
# and the end of its output, and stop with its exit status
quiet() {
    local log status
    log=$(mktemp)
    if "$@" >"$log" 2>&1; then
        grep "^\[setup\]" "$log" || true
        rm -f "$log"
        return 0
    else
        status=$?
    fi
    echo "[setup] FAILED (exit $status): $*" >&2
    tail -n 40 "$log" | sed 's/^/[setup]   /' >&2
    rm -f "$log"
    exit "$status"
}
# torch: PyPI's CUDA build where nvidia-smi lists a GPU, the CPU wheel elsewhere, FPSCALE_TORCH=<release>
# to choose (it replaces an installed torch of another release); scripts/torch_check.py has the rules
plan=$(.venv/bin/python scripts/torch_check.py plan)
if [ "${plan%%=*}" = "install torch" ]; then
    version=${plan#install torch==}
    version=${version%%:*}
    echo "[setup] ${plan#*: }"
    if .venv/bin/python -c "import torch" >/dev/null 2>&1; then
        quiet $PIP uninstall -y torch
    fi
    quiet $PIP install "torch==$version"
fi
if ! DS_ACCELERATOR=cpu .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
    echo "[setup] installing deepspeed (built against the installed torch)"
    quiet $PIP install setuptools wheel
    quiet $PIP install --no-build-isolation "deepspeed==0.19.8"
fi
# (re)install fpscale whenever pyproject.toml changed since the last install
stamp=".venv/.fpscale-pyproject.sha256"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing fpscale and its dependencies"
    quiet $PIP install -e ".[dev,hf]"
    echo "$want" > "$stamp"
fi
# DeepSpeed JIT-builds its shared-memory comm op on the first CPU run (~1 min): build it now
if .venv/bin/python -c "import torch, sys; sys.exit(1 if torch.cuda.is_available() else 0)"; then
    quiet env DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
fi
# on a GPU machine: can the driver run this torch's CUDA? (stops here, naming the fix, if not)
if ! gpu=$(.venv/bin/python scripts/torch_check.py driver); then
    echo "[setup] FAILED: $gpu" >&2
    exit 1
fi
echo "[setup] $gpu"
quiet env DS_ACCELERATOR=cpu .venv/bin/python -c "from fpscale.ops.kernel_plan import describe; print('[setup]', describe())"
quiet env DS_ACCELERATOR=cpu .venv/bin/python -c "import torch, deepspeed, fpscale; print(f'[setup] ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}, fpscale {fpscale.__version__}')"
