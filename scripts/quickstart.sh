#!/usr/bin/env bash
# The README's first command: set up a fresh machine, build the bundled corpus, and train the
# embedded default (configs/tiny_mixed.yaml: attn + fpsa + fpmamba + looped) with DeepSpeed on
# 2 processes (CPU: gloo, data parallel, ZeRO-1), ending with the validation perplexity and the
# iteration statistics of every looped layer, and the figure beside the one expected
# (scripts/quickstart_expected.json, the README's). Usage: bash scripts/quickstart.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=.venv/bin/python
$PY data/build_corpus.py --out cache/corpus/raw
$PY data/prepare_fineweb.py --files 'cache/corpus/raw/*.parquet' --out cache/corpus --vocab-size 8000 \
    --docs-per-shard 128 --val-fraction 0.05 --workers 2
NPROC=${NPROC:-2}
# a fresh run each time (train.resume=auto would continue the last one)
.venv/bin/deepspeed --num_gpus "$NPROC" launch/pretrain.py --config configs/tiny_mixed.yaml train.resume=none "$@"
$PY scripts/quickstart_check.py
