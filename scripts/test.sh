#!/usr/bin/env bash
# The test command: set up a fresh machine, then run the whole suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# FPSCALE_TEST_WORKERS pytest-xdist workers (default 2: CI's cores); 0 runs the suite in this process.
# loadfile: a test file runs whole, in its order, on one worker (one local SLURM cluster at a time, and a
# module's fixtures and once-per-process warnings as in a serial run).
exec .venv/bin/python -m pytest -q -n "${FPSCALE_TEST_WORKERS:-2}" --dist loadfile "$@"
