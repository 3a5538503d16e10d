#!/usr/bin/env bash
# The quickstart's measurement, shared by scripts/quickstart.sh (after set-up) and CI's check of the README's
# figure (tests/test_quickstart_figure.py, through scripts/test.sh): build the bundled corpus, train
# configs/tiny_mixed.yaml afresh with DeepSpeed on 2 processes (CPU: gloo, data parallel, ZeRO-1, one thread
# each). One script, so the figure CI checks is the one a user's quickstart measures.
#
#   bash scripts/quickstart_train.sh [key=value ...]      # after bash scripts/setup.sh
#
# Where (none of these moves the figure): FPSCALE_CORPUS (default cache/corpus: raw/ and tokens/, built once,
# reused while pinned), FPSCALE_RUNS (default runs: the run is FPSCALE_RUNS/tiny_mixed), MASTER_PORT (default
# DeepSpeed's 29500), PYTHON (default .venv/bin/python; deepspeed beside it). NPROC (default 2) does move it.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source scripts/pinned_kernels.sh        # one figure on every x86-64 CPU: the kernels' summation order pinned
PY=${PYTHON:-.venv/bin/python}
CORPUS=${FPSCALE_CORPUS:-cache/corpus}
RUNS=${FPSCALE_RUNS:-runs}
t0=$SECONDS
$PY data/build_corpus.py --out "$CORPUS/raw"
$PY data/prepare_fineweb.py --files "$CORPUS/raw/*.parquet" --out "$CORPUS" --vocab-size 8000 \
    --docs-per-shard 128 --val-fraction 0.05 --workers 2
echo "[quickstart] corpus ready in $((SECONDS - t0)) s"
t0=$SECONDS
NPROC=${NPROC:-2}
# a fresh run each time (train.resume=auto would continue the last one)
"$(dirname "$PY")/deepspeed" --num_gpus "$NPROC" ${MASTER_PORT:+--master_port "$MASTER_PORT"} launch/pretrain.py \
    --config configs/tiny_mixed.yaml train.resume=none data.path="$CORPUS/tokens" train.out_dir="$RUNS" "$@"
echo "[quickstart] trained in $((SECONDS - t0)) s"
