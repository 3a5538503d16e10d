#!/usr/bin/env bash
# The README's first command: set up a fresh machine, build the bundled corpus, and train the
# embedded default (configs/tiny_mixed.yaml: attn + fpsa + fpmamba + looped) with DeepSpeed on
# 2 processes (CPU: gloo, data parallel, ZeRO-1), ending with the validation perplexity and the
# iteration statistics of every looped layer, and the figure beside the one expected
# (scripts/quickstart_expected.json, the README's). Usage: bash scripts/quickstart.sh [key=value ...]
# The corpus and the training are scripts/quickstart_train.sh, which CI runs too (tests/test_quickstart_figure.py).
# After a change that moves the figure: bash scripts/quickstart.sh && .venv/bin/python scripts/quickstart_check.py --update
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/quickstart_train.sh "$@"
# the figure beside the README's (exit 0 either way); CI holds it to the README's: tests/test_quickstart_figure.py
.venv/bin/python scripts/quickstart_check.py
