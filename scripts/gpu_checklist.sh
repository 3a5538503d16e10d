#!/usr/bin/env bash
# The GPU checklist (scripts/gpu_checklist.py has the steps): one command, no network, a global
# deadline; gpu_report/results.jsonl gets one record per step as it finishes, gpu_report/summary.md
# the table. On a machine without a GPU the same steps run at CPU sizes (CI runs it).
#
#   bash scripts/gpu_checklist.sh [--budget-s 420] [--out gpu_report]
#
# The Python: $PYTHON, else .venv/bin/python (bash scripts/setup.sh), else python3 (the environment
# bash scripts/setup.sh --offline DIR installed into). docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
exec "$PY" scripts/gpu_checklist.py --python "$PY" "$@"
