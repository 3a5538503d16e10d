"""AdamW against MuonAdamW (issue 37) on tiny_attn, tiny_looped and tiny_fpsa: the same steps, tokens and
schedule, train.lr swept over three values for each optimizer, two seeds; validation perplexity at the end
and the looped layers' mean solver iterations at validation.

MuonAdamW here: Muon (Nesterov 0.95, 5 quintic Newton-Schulz steps in bf16, Moonlight's shape scale so
Muon shares train.lr with the AdamW groups, cautious decoupled weight decay 0.1) for the blocks' matrices,
AdamW for embeddings, norms and scalars (fpscale/train/optimizers.py).

    PYTHONPATH=. python experiments/optimizers.py --quick        # seconds: pipeline check
    PYTHONPATH=. python experiments/optimizers.py --threads 1 --steps 100
"""
from __future__ import annotations

import os
import statistics

from experiments.common import QUICK_LM, parse_args, plt, save, table, train_lm

MODELS = ("tiny_attn", "tiny_looped", "tiny_fpsa")
OPTIMIZERS = {"adamw": ["train.optimizer=adamw"], "muon_adamw": ["train.optimizer=muon_adamw"]}
LRS = (1e-3, 3e-3, 1e-2)
SEEDS = (1234, 1235)


def overrides(steps: int) -> list[str]:
    """The tiny configs' recipe (seq 128, global batch 16) cut to ``steps``: warm-up 10%, cosine to lr/10,
    one validation of 8 batches at the end."""
    return [f"train.steps={steps}", f"train.warmup={max(1, steps // 10)}", f"train.eval_interval={steps}",
            f"train.log_interval={max(1, steps // 4)}", "train.save_interval=0", "train.save_interval_minutes=0",
            "train.export_final=false", "train.keep_last=1"]


def main():
    args = parse_args(__doc__, lambda p: (p.add_argument("--steps", type=int, default=100),
                                          p.add_argument("--models", default=",".join(MODELS))))
    models = args.models.split(",")
    lrs, seeds = (LRS, SEEDS)
    if args.quick:
        models, lrs, seeds = models[:1], LRS[1:2], SEEDS[:1]
    runs_dir = os.path.join(args.out, "runs")
    runs = {}
    for model in models:
        for opt, over in OPTIMIZERS.items():
            for lr in lrs:
                for seed in seeds:
                    name = f"opt_{model}_{opt}_lr{lr:g}_s{seed}"
                    print(f"== {name}", flush=True)
                    extra = QUICK_LM if args.quick else overrides(args.steps)
                    r = train_lm(model, [*over, f"train.lr={lr}", f"train.min_lr={lr / 10}", f"seed={seed}", *extra],
                                 name, runs_dir, reuse=not (args.fresh or args.quick), data=args.data)
                    runs[name] = {"model": model, "optimizer": opt, "lr": lr, "seed": seed, **r}
    rows = []
    for model in models:
        for opt in OPTIMIZERS:
            for lr in lrs:
                rs = [r for r in runs.values() if r["model"] == model and r["optimizer"] == opt and r["lr"] == lr]
                ppl = [r["val_ppl"] for r in rs]
                iters = [st["iters_mean"] for r in rs for st in r["layers"].values() if "iters_mean" in st]
                rows.append([model, opt, lr, " / ".join(f"{p:.1f}" for p in ppl), statistics.mean(ppl),
                             statistics.mean(iters) if iters else "-", round(statistics.mean(r["wall_s"] for r in rs))])
    steps = 3 if args.quick else args.steps
    text = table(["model", "optimizer", "lr", "val ppl per seed", "mean", "val iterations (mean)", "wall s / run"],
                 rows, f"AdamW vs MuonAdamW, {steps} steps x 16 x 128 tokens, {len(seeds)} seed(s)")
    fig = plt().figure(figsize=(9, 3.2))
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        for opt in OPTIMIZERS:
            means = [statistics.mean(r["val_ppl"] for r in runs.values()
                                     if r["model"] == model and r["optimizer"] == opt and r["lr"] == lr) for lr in lrs]
            ax.plot(lrs, means, marker="o", label=opt)
        ax.set_xscale("log")
        ax.set_title(model)
        ax.set_xlabel("train.lr")
        ax.set_ylabel("val ppl")
        ax.legend()
    save(args, "optimizers", {"steps": steps, "runs": runs, "table": text}, fig)


if __name__ == "__main__":
    main()
