#!/usr/bin/env bash
# Collect every wheel a target environment lacks to run fpscale, for an offline install on a machine
# with no package registry (a cluster's GPU node): fpscale and DeepSpeed built into wheels here, binary
# wheels of the rest for the target's Python and platform, nothing its pip freeze lists, never torch.
#
#   bash scripts/wheelhouse.sh --python 3.12 --platform manylinux_2_28_x86_64 --have node-freeze.txt --out wheels
#   # copy wheels/ and this checkout to the node, then there:  bash scripts/setup.sh --offline wheels
#
# Runs on a connected machine, in the Python that builds the wheels: $PYTHON, else .venv/bin/python
# (after bash scripts/setup.sh), else python3; it needs pip, setuptools and wheel (DeepSpeed's build
# imports torch where it finds one). The logic and its options: scripts/wheelhouse.py. docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
exec "$PY" scripts/wheelhouse.py "$@"
