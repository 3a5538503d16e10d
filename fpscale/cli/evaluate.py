"""Evaluate a checkpoint (any layout) on this launch's layout.

    python launch/evaluate.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300
    torchrun --nproc_per_node 2 launch/evaluate.py --checkpoint DIR --tp 2      # TP2 (or DP2 with --tp 1)
    python launch/evaluate.py --checkpoint DIR --depths 1,2,4,8,16,64          # test-time compute sweep

Prints validation loss, perplexity and per-layer iteration statistics; writes eval.json and
iterations.png into --out (default: DIR/eval). --depths evaluates once more per depth, every looped
layer capped at that many solver iterations: eval.json gains "depths" (one record per depth), the
table is printed and depth.png plots loss and iterations against depth.

--precision: the numerics of the evaluation. ``config`` (default) is the run's train.precision, so the
losses and iteration counts are the ones training-time validation reported: bf16 autocast for a bf16
run, fp32 with TF32 matmuls on CUDA for an fp32 run. ``bf16`` and ``fp32`` ask for one of those,
``fp32-strict`` for IEEE fp32 (TF32 off). Exit code 2 for a checkpoint that cannot be read, a bad
--depths or a bad --precision (the codes: fpscale/errors.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from fpscale.cli import reported
from fpscale.errors import UserError


def parse_depths(text: str | None) -> list[int]:
    """``"1,2,8"`` -> [1, 2, 8] (sorted, duplicates dropped); None -> []. A UserError names --depths."""
    if text is None:
        return []
    try:
        depths = [int(part) for part in text.split(",")]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise UserError(f"--depths must be a comma-separated list of integers >= 1 (e.g. 1,2,4,8), got {text!r}")
    return sorted(set(depths))


def depth_table(records: list[dict]) -> list[str]:
    """The depth sweep as lines: depth, loss, perplexity, mean iterations of each looped layer."""
    names = list(records[0]["layers"]) if records else []
    widths = [max(len(n), 8) for n in names]
    head = f"{'depth':>6} {'loss':>8} {'ppl':>10}" + "".join(f"  {n:>{w}}" for n, w in zip(names, widths))
    rows = [f"{r['depth']:>6} {r['val_loss']:>8.4f} {r['val_ppl']:>10.2f}"
            + "".join(f"  {r['layers'][n]['iters_mean']:>{w}.2f}" for n, w in zip(names, widths)) for r in records]
    return [head] + rows


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder (runs/<name>/checkpoints/step_...)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this evaluation")
    ap.add_argument("--batches", type=int, default=None, help="validation batches (default: the run's eval_batches)")
    ap.add_argument("--depths", default=None, help="evaluation depths to sweep, e.g. 1,2,4,8,16,64 (solver "
                                                   "iteration caps of every looped layer)")
    ap.add_argument("--precision", default="config",
                    help="config (default: the run's train.precision), bf16 (autocast), fp32 (TF32 matmuls on "
                         "CUDA) or fp32-strict (IEEE fp32)")
    ap.add_argument("--out", default=None, help="report folder (default: CHECKPOINT/eval)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    depths = parse_depths(args.depths)
    from fpscale.train.precision import check_precision
    check_precision(args.precision)
    from fpscale.eval.evaluate import evaluate_checkpoint
    from fpscale.parallel.state import init_parallel
    state = init_parallel(args.tp)
    report = evaluate_checkpoint(args.checkpoint, state, args.out or os.path.join(args.checkpoint, "eval"),
                                 args.batches, depths, args.precision)
    if state.is_main:
        saved = report["saved_layout"]
        print(f"step {report['step']}: validation loss {report['val_loss']:.4f} ppl {report['val_ppl']:.2f} "
              f"in {report['precision']} (saved on tp {saved['tp']} x dp {saved['dp']}, evaluated on "
              f"tp {state.tp_size} x dp {state.dp_size})")
        for name, st in report["layers"].items():
            print(f"  {name:<18} iterations mean {st['iters_mean']:.2f} p90 {st['iters_p90']:.0f} "
                  f"max {st['iters_max']:.0f}  converged {st['converged_fraction']:.0%}")
        if depths:
            print("depth sweep (loss, perplexity, mean solver iterations of each looped layer):")
            print("\n".join(depth_table(report["depths"])))
    state.close()           # leave together: a rank that exits while rank 0 still writes aborts in gloo
    return 0


if __name__ == "__main__":
    sys.exit(main())
