"""AdamW against MuonAdamW (issue 37) on tiny_attn, tiny_looped and tiny_fpsa: the same steps, tokens and
schedule, train.lr swept over three values for each optimizer, two seeds; validation perplexity at the end
and the looped layers' mean solver iterations at validation.

MuonAdamW here: Muon (Nesterov 0.95, 5 quintic Newton-Schulz steps, in fp32 on the CPU: ns_dtype auto;
Moonlight's shape scale so Muon shares train.lr with the AdamW groups; cautious decoupled weight decay 0.1)
for the blocks' matrices, AdamW for embeddings, norms and scalars (fpscale/train/optimizers.py).

    PYTHONPATH=. python experiments/optimizers.py --quick        # seconds: pipeline check
    PYTHONPATH=. python experiments/optimizers.py --threads 1 --steps 60 --batch 8 --seq-len 64
    PYTHONPATH=. python experiments/optimizers.py --steps 60 --batch 8 --seq-len 64 --no-train   # the table so far
"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # as the other experiments

from experiments.common import QUICK_LM, parse_args, plt, save, table, train_lm  # noqa: E402

MODELS = ("tiny_attn", "tiny_looped", "tiny_fpsa")
# muon_adamw: fpscale's defaults (q/k/v part by part since issue 48); muon_fused: q/k/v as one matrix (the
# default before issue 48); muon_attractor: Attractor's MuonAdamW as configs/140m_attractor.yaml sets it
# (Keller's shape scale at the AdamW lr, polar express, NorMuon, decay x shape scale to 0, momentum warm-up
# 0.85 -> 0.95 over 300 steps: a fifth of it at 60, AdamW eps 1e-10)
OPTIMIZERS = {"adamw": ["train.optimizer=adamw"], "muon_adamw": ["train.optimizer=muon_adamw"],
              "muon_fused": ["train.optimizer=muon_adamw", "train.muon.split_fused=false"],
              "muon_attractor": ["train.optimizer=muon_adamw", "train.muon.shape_scale=keller",
                                 "train.muon.ns_coefficients=polar_express", "train.muon.normuon=true",
                                 "train.muon.wd_scale=step", "train.muon.wd_schedule=linear",
                                 "train.muon.momentum_warmup=300", "train.eps=1e-10"]}
LRS = (1e-3, 3e-3, 1e-2)
SEEDS = (1234, 1235)


def overrides(steps: int, seq_len: int, batch: int) -> list[str]:
    """The tiny configs' models cut to what the shared 2-core machine runs: ``steps`` of ``batch`` x
    ``seq_len`` tokens, warm-up 10%, cosine to lr/10, one validation of 8 batches at the end."""
    return [f"train.steps={steps}", f"train.warmup={max(1, steps // 10)}", f"train.eval_interval={steps}",
            f"train.log_interval={max(1, steps // 4)}", "train.save_interval=0", "train.save_interval_minutes=0",
            "train.export_final=false", "train.keep_last=1", f"data.seq_len={seq_len}", f"train.global_batch={batch}",
            f"train.micro_batch={batch}"]


def main():
    args = parse_args(__doc__, lambda p: (p.add_argument("--steps", type=int, default=100),
                                          p.add_argument("--seq-len", type=int, default=128),
                                          p.add_argument("--batch", type=int, default=16),
                                          p.add_argument("--models", default=",".join(MODELS)),
                                          p.add_argument("--seeds", default=",".join(map(str, SEEDS))),
                                          p.add_argument("--lrs", default=",".join(map(str, LRS))),
                                          p.add_argument("--optimizers", default="adamw,muon_adamw",
                                                         help=f"of {', '.join(OPTIMIZERS)}"),
                                          p.add_argument("--reverse", action="store_true",
                                                         help="train the runs in reverse order (a second process "
                                                              "working from the other end; kept runs are reused)"),
                                          p.add_argument("--no-train", action="store_true",
                                                         help="the table of the kept runs only")))
    models = args.models.split(",")
    lrs, seeds = tuple(float(x) for x in args.lrs.split(",")), tuple(int(x) for x in args.seeds.split(","))
    optimizers = {k: OPTIMIZERS[k] for k in args.optimizers.split(",")}
    if args.quick:
        models, lrs, seeds = models[:1], LRS[1:2], SEEDS[:1]
    runs_dir = os.path.join(args.out, "runs")
    runs = {}
    tag = "quick" if args.quick else f"{args.steps}x{args.batch}x{args.seq_len}"
    plan = [(seed, model, opt, over, lr) for seed in seeds for model in models       # a whole table per seed first
            for opt, over in optimizers.items() for lr in lrs]
    for seed, model, opt, over, lr in reversed(plan) if args.reverse else plan:
        name = f"opt_{tag}_{model}_{opt}_lr{lr:g}_s{seed}"
        extra = QUICK_LM if args.quick else overrides(args.steps, args.seq_len, args.batch)
        if args.no_train:
            path = os.path.join(runs_dir, f"{name}.result.json")
            if not os.path.exists(path):
                continue
            with open(path) as fh:
                r = json.load(fh)
        else:
            print(f"== {name}", flush=True)
            r = train_lm(model, [*over, f"train.lr={lr}", f"train.min_lr={lr / 10}", f"seed={seed}",
                                 *extra], name, runs_dir, reuse=not (args.fresh or args.quick),
                         data=args.data)
        runs[name] = {"model": model, "optimizer": opt, "lr": lr, "seed": seed, **r}
    rows = []
    for model in models:
        for opt in OPTIMIZERS:
            for lr in lrs:
                rs = [r for r in runs.values() if r["model"] == model and r["optimizer"] == opt and r["lr"] == lr]
                if not rs:
                    continue
                rs.sort(key=lambda r: r["seed"])
                ppl = [r["val_ppl"] for r in rs]
                iters = [st["iters_mean"] for r in rs for st in r["layers"].values() if "iters_mean" in st]
                rows.append([model, opt, lr, " / ".join(f"{p:.1f}" for p in ppl), statistics.mean(ppl),
                             statistics.mean(iters) if iters else "-", round(statistics.mean(r["wall_s"] for r in rs))])
    steps, batch, seq = (3, 4, 32) if args.quick else (args.steps, args.batch, args.seq_len)
    text = table(["model", "optimizer", "lr", "val ppl per seed", "mean", "val iterations (mean)", "wall s / run"],
                 rows, f"AdamW vs MuonAdamW, {steps} steps x {batch} x {seq} tokens, seeds "
                       f"{', '.join(map(str, seeds))}")
    fig = plt().figure(figsize=(9, 3.2))
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        for opt in OPTIMIZERS:
            pts = [(lr, statistics.mean(ppl)) for lr in lrs if (ppl := [r["val_ppl"] for r in runs.values() if (
                r["model"], r["optimizer"], r["lr"]) == (model, opt, lr)])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=opt)
        ax.set_xscale("log")
        ax.set_title(model)
        ax.set_xlabel("train.lr")
        ax.set_ylabel("val ppl")
        ax.legend()
    save(args, "optimizers", {"steps": steps, "batch": batch, "seq_len": seq, "runs": runs, "table": text}, fig)


if __name__ == "__main__":
    main()
