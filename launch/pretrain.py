"""Pretrain a looped LM.

    python launch/pretrain.py --config configs/tiny_fpsa.yaml [key.sub=value ...]

Single process for now; run directory runs/<name>/ gets config.yaml, metrics.jsonl and tb/.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.config import load_config  # noqa: E402
from fpscale.errors import ConfigError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (see configs/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from fpscale.train.trainer import Trainer
    trainer = Trainer(cfg)
    print(f"model: {trainer.model.num_params():,} parameters, layers {trainer.model.layer_types}", flush=True)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
