#!/usr/bin/env bash
# Set up fpscale, then print one line on which kernels each layer type will run. Two ways:
#
#   bash scripts/setup.sh [--venv]          # (default) a virtual environment in .venv with torch
#       installed first (the CPU wheel on a machine without a GPU, so nothing pulls CUDA packages;
#       PyPI's CUDA build where nvidia-smi lists a GPU, checked against the driver), DeepSpeed built
#       against it, and fpscale (editable, [dev,hf]); everything from the package registry.
#       FPSCALE_TORCH=<release> chooses torch. Idempotent: a second run only checks.
#
#   bash scripts/setup.sh --offline DIR     # (or FPSCALE_WHEELHOUSE=DIR) no registry (a cluster's GPU
#       node): fpscale into the CURRENT Python environment ($PYTHON, else python3), which must hold
#       torch already (the site's CUDA build): no venv, torch untouched (checked), every other wheel
#       from DIR (made on a connected machine by scripts/wheelhouse.sh) with pip --no-index.
#       docs/gpu.md has the whole recipe.
#
# Either way DeepSpeed's JIT-built ops go to <environment>/torch_extensions (fpscale/__init__.py),
# not the shared ~/.cache/torch_extensions, so two environments never rebuild each other's.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=venv
WHEELHOUSE=${FPSCALE_WHEELHOUSE:-}
[ -n "$WHEELHOUSE" ] && MODE=offline
while [ $# -gt 0 ]; do
    case $1 in
        --offline) MODE=offline; WHEELHOUSE=${2:?"--offline needs the wheelhouse folder (scripts/wheelhouse.sh --out DIR)"}; shift 2 ;;
        --offline=*) MODE=offline; WHEELHOUSE=${1#--offline=}; shift ;;
        --venv) MODE=venv; shift ;;
        *) echo "[setup] unknown argument $1 (usage: bash scripts/setup.sh [--venv | --offline DIR])" >&2; exit 2 ;;
    esac
done
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

if [ "$MODE" = offline ]; then
    PYBIN=${PYTHON:-python3}
    if [ ! -d "$WHEELHOUSE" ] || ! ls "$WHEELHOUSE"/fpscale-*.whl >/dev/null 2>&1; then
        echo "[setup] FAILED: $WHEELHOUSE holds no fpscale wheel: make it on a connected machine with" \
             "bash scripts/wheelhouse.sh --python X.Y --platform TAG --have FREEZE.txt --out DIR (docs/gpu.md)" >&2
        exit 2
    fi
    torch_id='import torch, os; print(torch.__version__, os.path.dirname(torch.__file__))'
    if ! before=$("$PYBIN" -c "$torch_id" 2>/dev/null); then
        echo "[setup] FAILED: $PYBIN ($(command -v "$PYBIN")) has no torch: the offline install goes over an" \
             "installed torch (the site's CUDA build); bash scripts/setup.sh --venv makes a venv with one instead" >&2
        exit 2
    fi
    echo "[setup] offline: into $("$PYBIN" -c 'import sys; print(sys.prefix)') over torch ${before%% *}, wheels from $WHEELHOUSE"
    PIP="$PYBIN -m pip --disable-pip-version-check -q"
    # the dependencies (what the environment holds stays), then fpscale itself, replaced every time
    # with the fused loss head's liger-kernel where the wheelhouse carries it (its default --extras)
    extra=""
    if ls "$WHEELHOUSE"/liger_kernel-*.whl >/dev/null 2>&1; then extra="[liger]"; fi
    quiet env PIP_NO_INDEX=1 $PIP install --no-index --find-links "$WHEELHOUSE" "fpscale$extra"
    quiet env PIP_NO_INDEX=1 $PIP install --no-index --no-deps --force-reinstall "$(ls "$WHEELHOUSE"/fpscale-*.whl | head -n 1)"
    after=$("$PYBIN" -c "$torch_id")
    if [ "$before" != "$after" ]; then
        echo "[setup] FAILED: torch changed ($before -> $after): a wheel in $WHEELHOUSE replaced it" >&2
        exit 1
    fi
else
    PY=${PYTHON:-python3}
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    PYBIN=.venv/bin/python
    PIP="$PYBIN -m pip --disable-pip-version-check -q"
    # torch: PyPI's CUDA build where nvidia-smi lists a GPU, the CPU wheel elsewhere, FPSCALE_TORCH=<release>
    # to choose (it replaces an installed torch of another release); scripts/torch_check.py has the rules
    plan=$($PYBIN scripts/torch_check.py plan)
    if [ "${plan%%=*}" = "install torch" ]; then
        version=${plan#install torch==}
        version=${version%%:*}
        echo "[setup] ${plan#*: }"
        if $PYBIN -c "import torch" >/dev/null 2>&1; then
            quiet $PIP uninstall -y torch
        fi
        quiet $PIP install "torch==$version"
    fi
    if ! DS_ACCELERATOR=cpu $PYBIN -c "import deepspeed" >/dev/null 2>&1; then
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
fi
# DeepSpeed JIT-builds its shared-memory comm op on the first multi-process CPU run (~1 min): the venv
# builds it now, into this environment's torch_extensions (importing fpscale points TORCH_EXTENSIONS_DIR
# there); an offline install (a GPU node's) leaves it to the first CPU run that needs it, same folder
if [ "$MODE" = venv ] && $PYBIN -c "import torch, sys; sys.exit(1 if torch.cuda.is_available() else 0)"; then
    quiet env DS_ACCELERATOR=cpu $PYBIN -c "import fpscale; from deepspeed.comm.torch import build_shm_op; build_shm_op()"
fi
# on a GPU machine: can the driver run this torch's CUDA? (stops here, naming the fix, if not)
if ! gpu=$($PYBIN scripts/torch_check.py driver); then
    echo "[setup] FAILED: $gpu" >&2
    exit 1
fi
echo "[setup] $gpu"
quiet env DS_ACCELERATOR=cpu $PYBIN -c "from fpscale.ops.kernel_plan import describe; print('[setup]', describe())"
quiet env DS_ACCELERATOR=cpu $PYBIN -c "import torch, deepspeed, fpscale; print(f'[setup] ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}, fpscale {fpscale.__version__}')"
