"""Pretrain a looped LM.

    python launch/pretrain.py --config configs/tiny_fpsa.yaml [key.sub=value ...]

    deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny_mixed.yaml      # 2 processes (CPU: gloo)
    torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny_mixed.yaml

Several processes train through DeepSpeed (ZeRO stage parallel.zero_stage); one process trains
with torch's AdamW, or through DeepSpeed where the ``deepspeed`` launcher started it, where
parallel.zero_stage is set, or with parallel.engine=deepspeed (``deepspeed --num_gpus 1
launch/pretrain.py ...``: ZeRO on one GPU, the cluster job's optimizer path). The run directory
runs/<name>/ gets config.yaml, metrics.jsonl, tb/,
checkpoints/ (every train.save_interval steps and at the end) and, with train.export_final,
final/ (whole weights as safetensors; launch/convert.py makes them from any checkpoint).
``train.resume: auto`` (the default) continues from the newest complete checkpoint.

Exit codes (fpscale/errors.py): 0 done; 1 an unexpected error (traceback); 2 a config, path,
layout, data or checkpoint mistake (one line naming it); 69 a peer rank vanished (named);
74 a disk filled during a save (the last complete checkpoint is intact); 75 preempted: SIGTERM
or SIGUSR1 made every rank save at the next step boundary (resume with the same command).
"""
from __future__ import annotations

import argparse
import sys

from fpscale.cli import reported
from fpscale.config import load_config
from fpscale.errors import EXIT_PREEMPTED


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (see configs/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)   # set by deepspeed
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    from fpscale.train.trainer import Trainer
    trainer = Trainer(cfg)
    if trainer.state.is_main:
        print(f"model: {trainer.model.num_params():,} parameters, layers {trainer.model.layer_types}; "
              f"world {trainer.state.world_size} (dp {trainer.state.dp_size}, engine {trainer.state.engine}, zero "
              f"{cfg.parallel.zero_stage if trainer.state.deepspeed else '-'})", flush=True)
    with trainer:                          # leaves NCCL / gloo together and cleanly
        trainer.train()
    return EXIT_PREEMPTED if trainer.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
