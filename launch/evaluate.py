"""Evaluate a checkpoint (any layout) on this launch's layout.

    python launch/evaluate.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300
    torchrun --nproc_per_node 2 launch/evaluate.py --checkpoint DIR --tp 2      # TP2 (or DP2 with --tp 1)

Prints validation loss, perplexity and per-layer iteration statistics; writes eval.json and
iterations.png into --out (default: DIR/eval). Exit code 2 for a checkpoint that cannot be read.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder (runs/<name>/checkpoints/step_...)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this evaluation")
    ap.add_argument("--batches", type=int, default=None, help="validation batches (default: the run's eval_batches)")
    ap.add_argument("--out", default=None, help="report folder (default: CHECKPOINT/eval)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from fpscale.eval.evaluate import evaluate_checkpoint
    from fpscale.parallel.state import init_parallel
    from fpscale.train.checkpoint import CheckpointError
    try:
        state = init_parallel(args.tp)
        report = evaluate_checkpoint(args.checkpoint, state, args.out or os.path.join(args.checkpoint, "eval"),
                                     args.batches)
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if state.is_main:
        print(f"step {report['step']}: validation loss {report['val_loss']:.4f} ppl {report['val_ppl']:.2f} "
              f"(saved on tp {report['saved_layout']['tp']} x dp {report['saved_layout']['dp']}, evaluated on "
              f"tp {state.tp_size} x dp {state.dp_size})")
        for name, st in report["layers"].items():
            print(f"  {name:<18} iterations mean {st['iters_mean']:.2f} p90 {st['iters_p90']:.0f} "
                  f"max {st['iters_max']:.0f}  converged {st['converged_fraction']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
