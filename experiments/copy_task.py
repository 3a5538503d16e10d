"""Seed 002 (Fixed-Point RNNs), Table 1 / Fig. 2b, scaled down: copying (Jelassi et al.). A string of
n random characters, a separator, then the model must repeat the string. Train on n in [4, 16], test
the character accuracy at 2x the training length (n in [17, 32]) and in distribution. Models (d 64):
  FP-Mamba 1 layer, Householder r = 2, shifted y_{t-1} feedback into B, C, Delta and Q (the seed's)
  FP-Mamba 1 layer, the same without the y_{t-1} feedback (Table 1's ablation)
  Mamba 2 layers (mixer none, one iteration), attention 2 layers

    PYTHONPATH=. python experiments/copy_task.py            # full: ~12 min on 2 cores
    PYTHONPATH=. python experiments/copy_task.py --quick    # seconds: pipeline check

Scale-down (experiments/README.md): lengths [5, 50] -> [4, 16] and test at 2x ([17, 32]); vocabulary 29 -> 28 (26
characters, SEP, PAD); 10,000 steps x 128 at lr 1e-5 -> a few hundred steps x 32 at lr 3e-3 (the same
for every model).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments.common import Timer, eval_aligned, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402
from fpscale.data.synthetic import SyntheticTask  # noqa: E402

D, VOCAB, TRAIN = 64, 28, (4, 16)
FP_SOLVER = {"max_iter": 16, "eval_max_iter": 64, "tol": 0.1, "stop_quantile": 0.25, "patience": 3,
             "decay": 0.5, "eta_min": 0.05, "backward": "jfb"}
MODELS = {
    "FP-Mamba 1L Householder r2": ([{"type": "fpmamba", "mixer": "householder", "mixer_rank": 2, "d_state": 16}],
                                   FP_SOLVER),
    "FP-Mamba 1L, no y feedback": ([{"type": "fpmamba", "mixer": "householder", "mixer_rank": 2, "d_state": 16,
                                     "y_feedback": False}], FP_SOLVER),
    "Mamba 2L": ([{"type": "fpmamba", "mixer": "none", "y_feedback": False, "d_state": 16, "repeat": 2}],
                 {**FP_SOLVER, "max_iter": 1, "eval_max_iter": 1}),
    "attention 2L": ([{"type": "attn", "repeat": 2}], {}),
}


def main():
    args = parse_args(__doc__)
    steps, batch, n_eval = (3, 8, 16) if args.quick else (600, 32, 256)
    lr = 3e-3
    train_task = SyntheticTask("copy_sep", VOCAB, 2 * TRAIN[1], seed=1, min_len=TRAIN[0], max_len=TRAIN[1])
    tests = {"in distribution [4, 16]": SyntheticTask("copy_sep", VOCAB, 2 * TRAIN[1], seed=7, min_len=TRAIN[0],
                                                      max_len=TRAIN[1]),
             "2x length [17, 32]": SyntheticTask("copy_sep", VOCAB, 4 * TRAIN[1], seed=8, min_len=TRAIN[1] + 1,
                                                 max_len=2 * TRAIN[1])}
    results = {"settings": {"d_model": D, "vocab": VOCAB, "train_lengths": TRAIN, "steps": steps, "batch": batch,
                            "lr": lr, "solver": FP_SOLVER}, "models": {}}
    with Timer() as total:
        for name, (layers, solver) in MODELS.items():
            model, _ = small_model(VOCAB, D, layers, solver, max_seq_len=4 * TRAIN[1])
            with Timer() as t:
                curve = train_aligned(model, train_task, steps, batch, lr, warmup=min(50, steps // 4 + 1),
                                      log_every=max(1, steps // 5), label=name)
            r = {"params": model.num_params(), "train_s": t.s, "curve": curve, "tests": {}}
            for tname, task in tests.items():
                ev = eval_aligned(model, task, n_eval, batch=min(n_eval, 128))
                r["tests"][tname] = {"char_acc": ev["token_acc"],
                                     "iters": float(np.median(ev["iters"])) if ev["iters"] else 1.0}
            results["models"][name] = r
    tn = list(tests)
    rows = [[name, r["params"]] + [r["tests"][t]["char_acc"] for t in tn] + [r["tests"][tn[1]]["iters"],
                                                                             round(r["train_s"])]
            for name, r in results["models"].items()]
    text = table(["model", "params"] + [f"char acc {t}" for t in tn] + ["median iters (2x)", "train s"], rows,
                 f"copy: character accuracy (chance {1 / (VOCAB - 2):.3f})")
    print(f"total wall {total.s:.0f} s", flush=True)
    results["wall_s"] = total.s
    fig = plt().figure(figsize=(6, 3.6))
    ax = fig.add_subplot(111)
    x = np.arange(len(results["models"]))
    for i, t in enumerate(tn):
        ax.bar(x + 0.4 * i, [r["tests"][t]["char_acc"] for r in results["models"].values()], 0.4, label=t)
    ax.set_xticks(x + 0.2, [n.replace(" ", "\n", 2) for n in results["models"]], fontsize=6)
    ax.set_ylabel("character accuracy"), ax.set_ylim(0, 1.02), ax.legend(fontsize=7)
    save(args, "copy_task", {**results, "table": text}, fig)


if __name__ == "__main__":
    main()
