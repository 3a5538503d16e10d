"""Pretrain a looped LM.

    python launch/pretrain.py --config configs/tiny_fpsa.yaml [key.sub=value ...]

    deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny_mixed.yaml      # 2 processes (CPU: gloo)
    torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny_mixed.yaml

Several processes train through DeepSpeed (ZeRO stage parallel.zero_stage); one process trains
with torch's AdamW. The run directory runs/<name>/ gets config.yaml, metrics.jsonl and tb/.
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
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)   # set by deepspeed
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from fpscale.train.trainer import Trainer
    try:
        trainer = Trainer(cfg)
    except ValueError as exc:          # batch geometry / world size that cannot work
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if trainer.state.is_main:
        print(f"model: {trainer.model.num_params():,} parameters, layers {trainer.model.layer_types}; "
              f"world {trainer.state.world_size} (dp {trainer.state.dp_size}, zero "
              f"{cfg.parallel.zero_stage if trainer.state.distributed else '-'})", flush=True)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
