"""Seed 004 (FPRM), Fig. 2a at CPU scale: the longest word length solved above 90% against the number of
loops, for a looped transformer (a Universal Transformer: a fixed number of loops, no halting) with
post-norm, pre-norm, and pre-norm with residual scaling (fpscale's looped core with tol 0).

Each normalisation is trained at each number of loops L with the task length matched to it (words of length
L: the regime the paper describes, "the iteration budget matched to the task length"), backpropagating
through all L loops (unroll), then evaluated at L loops on fresh words of lengths 2-32; the row reports the
longest length whose accuracy (the state after all n elements) is above 90%.

    PYTHONPATH=. python experiments/trainability.py                # full: S3, loops 2/4/8/16, ~10 min
    PYTHONPATH=. python experiments/trainability.py --group a5     # the paper's group (at chance at this budget)
    PYTHONPATH=. python experiments/trainability.py --quick        # seconds: pipeline check

Scale-down (experiments/README.md): the paper trains UTs of 2 layers (TRM width) 30 epochs at global batch 1024, lr 1e-4
(Table 6) on A5; here d_model 64, STEPS x 32 words (the full setting: 2,000 x 32 = 64,000), lr 3e-3, and S3 by
default: at this budget no model learns A5 at any length (experiments/README.md, state tracking and A5).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import Timer, eval_aligned, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402
from experiments.length_generalisation import PostNormLoop, PreNormLoop  # noqa: E402
from fpscale.data.synthetic import SyntheticTask, group_elements  # noqa: E402

D = 64
NORMS = {"post-norm": PostNormLoop, "pre-norm": PreNormLoop, "pre-norm + residual scaling": None}
EVAL_LENGTHS = [2, 3, 4, 6, 8, 12, 16, 24, 32]


def run_one(group: str, norm: str, loops: int, steps: int, batch: int, lr: float, n_eval: int, lengths) -> dict:
    vocab = len(group_elements(group))
    solver = {"max_iter": loops, "eval_max_iter": loops, "tol": 0.0, "patience": 0, "eta_min": 0.0,
              "backward": "unroll"}
    model, _ = small_model(vocab, D, [{"type": "looped", "core_blocks": 1}], solver, max_seq_len=max(lengths))
    if NORMS[norm] is not None:
        model.layers[0].__class__ = NORMS[norm]
    with Timer() as t:
        curve = train_aligned(model, SyntheticTask(group, vocab, loops, seed=1), steps, batch, lr,
                              warmup=min(50, steps // 4 + 1), log_every=max(1, steps // 4), label=f"{norm} L{loops}")
    acc = {n: eval_aligned(model, SyntheticTask(group, vocab, n, seed=10_000 + n), n_eval, batch=n_eval)["last_acc"]
           for n in lengths}
    solved = max([n for n in lengths if acc[n] > 0.9], default=0)
    print(f"  {norm} loops {loops}: longest solved {solved}  {acc}", flush=True)
    return {"acc": acc, "solved": solved, "train_s": t.s, "curve": curve, "params": model.num_params()}


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--group", default="s3", help="s3, a4 or a5"))
    if args.quick:
        loops_list, steps, batch, n_eval, lengths = [2], 2, 4, 8, [2, 4]
    else:
        loops_list, steps, batch, n_eval, lengths = [2, 4, 8, 16], 2000, 32, 128, EVAL_LENGTHS
    lr, group = 3e-3, args.group
    runs: dict = {}
    with Timer() as total:
        for norm in NORMS:
            for loops in loops_list:
                runs[f"{norm}|{loops}"] = run_one(group, norm, loops, steps, batch, lr, n_eval, lengths)
    rows = [[norm] + [runs[f"{norm}|{L}"]["solved"] for L in loops_list] +
            [round(sum(runs[f"{norm}|{L}"]["train_s"] for L in loops_list))] for norm in NORMS]
    text = table(["normalisation"] + [f"loops {L}" for L in loops_list] + ["train s"], rows,
                 f"{group.upper()}: longest length solved above 90% (trained at length = loops)")
    acc_rows = [[norm, L] + [runs[f"{norm}|{L}"]["acc"][n] for n in lengths] for norm in NORMS for L in loops_list]
    text += "\n" + table(["normalisation", "loops"] + [f"acc@{n}" for n in lengths], acc_rows, "accuracy by length")
    print(f"total wall {total.s:.0f} s", flush=True)
    fig = plt().figure(figsize=(4.5, 3.6))
    ax = fig.add_subplot(111)
    for norm in NORMS:
        ax.plot(loops_list, [runs[f"{norm}|{L}"]["solved"] for L in loops_list], marker="o", label=norm)
    ax.set_xlabel("loops (= training length)"), ax.set_ylabel("longest length > 90%"), ax.legend(fontsize=7)
    ax.set_title(f"{group.upper()}: trainability (Fig. 2a)")
    save(args, "trainability", {"settings": {"group": group, "d_model": D, "steps": steps, "batch": batch, "lr": lr,
                                             "loops": loops_list, "lengths": lengths},
                                "runs": runs, "table": text, "wall_s": total.s}, fig)


if __name__ == "__main__":
    main()
