#!/usr/bin/env bash
# The test command: set up a fresh machine, then run the whole suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# FPSCALE_TEST_WORKERS=N: N pytest-xdist workers, each with one OpenMP thread (default 0: serial, the
# measured CI setting; 2 workers on the 2-core machine were not shown faster). loadfile: a test file runs
# whole, in its order, on one worker (one local SLURM cluster at a time, module fixtures as in a serial run).
workers=${FPSCALE_TEST_WORKERS:-0}
if [ "$workers" = 0 ]; then threads=2; else threads=1; fi
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
