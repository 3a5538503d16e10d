"""Write the offline lm-evaluation-harness task fpscale_cloze from held-out documents.

    python launch/lm_eval_task.py --files cache/corpus/raw/corpus.parquet --out runs/lm_eval_tasks
    lm_eval --model hf --model_args pretrained=exported/hf,trust_remote_code=True,eval_depth=8 \\
            --include_path runs/lm_eval_tasks --tasks fpscale_cloze --output_path runs/lm_eval/depth_8

Exit code 2 for input that cannot make a task (no such file, no validation document).
"""
from __future__ import annotations

import argparse
import sys

from fpscale.cli import reported


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", required=True, help="parquet / jsonl documents (FineWeb schema)")
    ap.add_argument("--out", required=True, help="folder for fpscale_cloze.yaml and its jsonl (--include_path)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--val-fraction", type=float, default=0.05,
                    help="the documents held out by data/prepare_fineweb.py (its --val-fraction)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from fpscale.eval.cloze import write_task
    path = write_task(args.files, args.out, args.items, args.val_fraction, args.seed)
    print(f"wrote {path}: lm_eval ... --include_path {args.out} --tasks fpscale_cloze")
    return 0


if __name__ == "__main__":
    sys.exit(main())
