"""Seed 002 (Fixed-Point RNNs), Figs. 1-4, scaled down: state tracking on the group word problems
of Merrill et al. (S3, A4, A5: input a word g_1..g_T of group elements, target at each position the
product so far). Train at length 16, test at lengths 2-64. Models (d_model 64):
  FP-Mamba 1 layer, Kronecker mixer (negative eigenvalues)      fpmamba mixer=kronecker
  FP-Mamba 1 layer, Householder r = 4 with negative eigenvalues fpmamba mixer=householder
  Mamba 2 layers (mixer none, one iteration)                    fpmamba mixer=none, max_iter 1
  attention 2 layers                                            attn x 2
The claims tested: only the fixed-point model tracks the state at the training length and beyond
(Figs. 2a, 4); its iteration count grows with the sequence length (Fig. 3c); and (Fig. 1) accuracy
falls once the training cap (max_iter 2, 4, 8, 16) is below the training length.

    PYTHONPATH=. python experiments/state_tracking.py          # full (S3, A5): 6.5 min idle (--threads 2)
    PYTHONPATH=. python experiments/state_tracking.py --quick     # seconds: pipeline check

Scale-down (experiments/README.md): the paper trains 5 epochs x 25,428 steps at batch 512 (127,140 steps, 65.1M
sequences; App. E.2, whose "around 1.25M" iterations is 10x its own count) with lr 1e-4; here each model
gets 400 steps x 32 sequences (12,800, about 5,100x fewer) at lr 3e-3, the same for every model;
d_state 8. The full setting runs S3 and A5 (--groups s3,a4,a5 adds A4) and the cap sweep on S3.
Accuracy at length n is the accuracy of the state after all n elements (the last position) on
fresh words of length n.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hashlib  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from experiments.common import Timer, eval_aligned, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402
from fpscale.data.synthetic import SyntheticTask, group_elements  # noqa: E402

D = 64
FP_SOLVER = {"max_iter": 16, "eval_max_iter": 64, "tol": 0.1, "stop_quantile": 0.25, "patience": 3,
             "decay": 0.5, "eta_min": 0.05, "backward": "jfb"}
MODELS = {
    "FP-Mamba 1L Kronecker": ([{"type": "fpmamba", "mixer": "kronecker", "negative_eigs": True, "d_state": 8}],
                              FP_SOLVER),
    "FP-Mamba 1L Householder r4": ([{"type": "fpmamba", "mixer": "householder", "mixer_rank": 4,
                                     "negative_eigs": True, "d_state": 8}], FP_SOLVER),
    "Mamba 2L": ([{"type": "fpmamba", "mixer": "none", "y_feedback": False, "d_state": 8, "repeat": 2}],
                 {**FP_SOLVER, "max_iter": 1, "eval_max_iter": 1}),
    "attention 2L": ([{"type": "attn", "repeat": 2}], {}),
}
TRAIN_LEN = 16
LENGTHS = [2, 4, 8, 16, 24, 32, 48, 64]


def run_one(group: str, name: str, layers, solver, steps: int, batch: int, lr: float, n_eval: int, lengths,
            keep: str | None = None):
    """Train and evaluate one model; with ``keep`` (a folder) the result is kept there and reused for the
    very same setting."""
    setting = json.dumps([group, name, layers, solver, steps, batch, lr, n_eval, lengths, D, TRAIN_LEN])
    path = os.path.join(keep, "state_" + hashlib.sha1(setting.encode()).hexdigest()[:12] + ".json") if keep else None
    if path and os.path.exists(path):
        print(f"reusing {path} ({group} {name}; --fresh to retrain)", flush=True)
        with open(path) as fh:
            out = json.load(fh)
        out["by_length"] = {int(k): v for k, v in out["by_length"].items()}
        return out
    vocab = len(group_elements(group))
    model, _ = small_model(vocab, D, layers, solver, max_seq_len=max(lengths))
    task = SyntheticTask(group, vocab, TRAIN_LEN, seed=1)
    with Timer() as t:
        curve = train_aligned(model, task, steps, batch, lr, warmup=min(50, steps // 4 + 1),
                              log_every=max(1, steps // 5), label=f"{group} {name}")
    res = {"params": model.num_params(), "train_s": t.s, "curve": curve, "by_length": {}}
    for n in lengths:
        ev = eval_aligned(model, SyntheticTask(group, vocab, n, seed=10_000 + n), n_eval, batch=n_eval)
        res["by_length"][n] = {"last_acc": ev["last_acc"], "token_acc": ev["token_acc"],
                               "iters": float(np.median(ev["iters"])) if ev["iters"] else 1.0}
    if path:
        os.makedirs(keep, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(res, fh)
    return res


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--groups", default="s3,a5", help="of s3, a4, a5"))
    if args.quick:
        groups, steps, n_eval, lengths, caps, batch = ["s3"], 3, 16, [2, 16, 32], [2, 16], 8
    else:
        groups, steps, n_eval, lengths, caps, batch = args.groups.split(","), 400, 128, LENGTHS, [2, 4, 8, 16], 32
    lr = 3e-3
    keep = None if (args.quick or args.fresh) else os.path.join(args.out, "runs")
    results: dict = {"settings": {"d_model": D, "train_len": TRAIN_LEN, "steps": steps, "batch": batch, "lr": lr,
                                  "solver": FP_SOLVER, "lengths": lengths}, "main": {}, "caps": {}}
    with Timer() as total:
        for g in groups:
            for name, (layers, solver) in MODELS.items():
                results["main"][f"{g}|{name}"] = run_one(g, name, layers, solver, steps, batch, lr, n_eval,
                                                         lengths, keep)
        cap_group, cap_model = groups[0], "FP-Mamba 1L Householder r4"
        layers, solver = MODELS[cap_model]
        for cap in caps:
            if cap == solver["max_iter"]:      # the main run already trained at this cap
                results["caps"][cap] = results["main"][f"{cap_group}|{cap_model}"]
                continue
            results["caps"][cap] = run_one(cap_group, f"{cap_model} cap {cap}", layers,
                                           {**solver, "max_iter": cap}, steps, batch, lr, n_eval, lengths, keep)
    show = [n for n in lengths if n in (2, 8, 16, 24, 32, 64)] or lengths
    rows = []
    for key, r in results["main"].items():
        g, name = key.split("|")
        rows.append([g, name, r["params"]] + [r["by_length"][n]["last_acc"] for n in show] +
                    [r["by_length"][TRAIN_LEN if TRAIN_LEN in r["by_length"] else show[-1]]["iters"],
                     r["by_length"][show[-1]]["iters"], round(r["train_s"])])
    text = table(["group", "model", "params"] + [f"acc@{n}" for n in show] +
                 [f"iters@{TRAIN_LEN}", f"iters@{show[-1]}", "train s"], rows,
                 f"state tracking: accuracy of the state after n elements (trained at n = {TRAIN_LEN})")
    it_rows = [[key.split("|")[1] + " " + key.split("|")[0]] + [r["by_length"][n]["iters"] for n in lengths]
               for key, r in results["main"].items() if "FP" in key]
    text += "\n" + table(["model"] + [f"n={n}" for n in lengths], it_rows,
                         "median solver iterations in evaluation against the word length (Fig. 3c)")
    cap_rows = [[cap] + [r["by_length"][n]["last_acc"] for n in show] + [round(r["train_s"])]
                for cap, r in results["caps"].items()]
    text += "\n" + table(["train cap"] + [f"acc@{n}" for n in show] + ["train s"], cap_rows,
                         f"accuracy against the training cap ({cap_group}, FP-Mamba Householder r4; Fig. 1)")
    print(f"total wall {total.s:.0f} s", flush=True)
    results["wall_s"] = total.s
    fig = plt().figure(figsize=(4 * len(groups) + 4, 3.6))
    for i, g in enumerate(groups):
        ax = fig.add_subplot(1, len(groups) + 1, i + 1)
        for key, r in results["main"].items():
            if key.startswith(g + "|"):
                ax.plot(lengths, [r["by_length"][n]["last_acc"] for n in lengths], marker=".", label=key.split("|")[1])
        ax.axvline(TRAIN_LEN, color="pink", ls="--")
        ax.set_title(g.upper()), ax.set_xlabel("length"), ax.set_ylabel("accuracy"), ax.set_ylim(0, 1.02)
        ax.legend(fontsize=6)
    ax = fig.add_subplot(1, len(groups) + 1, len(groups) + 1)
    for cap, r in results["caps"].items():
        ax.plot(lengths, [r["by_length"][n]["last_acc"] for n in lengths], marker=".", label=f"cap {cap}")
    ax.axvline(TRAIN_LEN, color="pink", ls="--")
    ax.set_title(f"{cap_group.upper()}: training cap"), ax.set_xlabel("length"), ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6)
    save(args, "state_tracking", {**results, "table": text}, fig)


if __name__ == "__main__":
    main()
