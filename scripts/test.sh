#!/usr/bin/env bash
# The test command: set up a fresh machine, then run the whole suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# FPSCALE_TEST_WORKERS=N: N pytest-xdist workers (default 2; 0: serial). With one OpenMP thread per test
# process a serial run leaves a core idle whenever a test runs in process: on the 2-core machine at 993e70d
# the whole suite took 2,268 s on 2 workers against 3,452 s serial (fresh clones, all passed), the quick loop
# 88 s against 110-160 s. loadfile: a test file runs whole, in its order, on one worker (one local SLURM
# cluster at a time, module fixtures as in a serial run).
# One OpenMP thread per process, serial too (it was 2): at load ~3 on the 2-core machine the quick loop took
# 116 s with 1 thread against 153 s with 2 (idle threads sleeping: tests/conftest.py), and at 34d2cd5 155 s
# against 160 s with 2 spinning (387 s spinning at load ~5); the in-process tests' ops are small, and
# every rank a test launches has 1 thread already.
workers=${FPSCALE_TEST_WORKERS:-2}
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --durations: the log ends with the slowest tests (the whole suite should take under 30 minutes)
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=20 "$@"
