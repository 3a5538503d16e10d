"""Convert between sharded checkpoints and one safetensors file.

    # sharded checkpoint (any TP x DP x ZeRO layout, or one process) -> model.safetensors + config.yaml
    python launch/convert.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300 --out exported/

    # and back: whole weights -> a step-0 sharded checkpoint of run NAME on this launch's layout,
    # which `launch/pretrain.py ... name=NAME` then resumes (fresh optimizer, the weights kept)
    torchrun --nproc_per_node 2 launch/convert.py --weights exported/ --name NAME [key=value ...]

The config of the exported weights travels with them (config.yaml); overrides apply on top
(e.g. parallel.tp=2, train.out_dir=...). Exit code 2 for input that cannot be converted.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="sharded checkpoint folder to consolidate")
    ap.add_argument("--out", help="output folder for model.safetensors + config.yaml")
    ap.add_argument("--weights", help="folder with model.safetensors + config.yaml to shard")
    ap.add_argument("--name", help="run name of the sharded checkpoint written from --weights")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the weights' config")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from fpscale.errors import ConfigError
    from fpscale.train.checkpoint import CheckpointError
    try:
        if args.checkpoint and args.out:
            from fpscale.train.checkpoint import export_safetensors, verify
            problem = verify(args.checkpoint)
            if problem:
                raise CheckpointError(f"cannot convert {args.checkpoint}: {problem}")
            export_safetensors(args.checkpoint, args.out)
            print(f"wrote {os.path.join(args.out, 'model.safetensors')} and config.yaml")
            return 0
        if args.weights and args.name:
            import fpscale
            from fpscale.train.trainer import Trainer
            cfg = fpscale.load_config(os.path.join(args.weights, "config.yaml"), [
                f"name={args.name}", f"train.init_weights={args.weights}", "train.resume=none", *args.overrides])
            with Trainer(cfg, log=False) as trainer:
                trainer.save_checkpoint()
            return 0
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ap.error("give --checkpoint and --out, or --weights and --name")


if __name__ == "__main__":
    sys.exit(main())
