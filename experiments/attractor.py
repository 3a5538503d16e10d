"""Attractor (jacobfa/Attractor's implicit head, fpscale's ``attractor`` layer) against attention on the
bundled corpus at CPU scale, with the comparisons their table lacks.

Stacks (d 128, ReLU^2 MLP at 4d, QK-norm, their scaled-zero orthogonal init, configs/tiny_attractor.yaml):
  attractor         3 attention blocks -> a head of 2 weight-tied blocks solved to y* (Neumann-1 backward)
  attn (their ratio)  2 attention blocks: about their table's ratio of block parameters (their same-label
                    GPTs hold 2.0-2.4x fewer block parameters than Attractor and the rest in value
                    embeddings, which fpscale does not build: here the blocks alone)
  attn (= params)   5 attention blocks: Attractor's block (and total) parameters
  attn (= FLOPs)    3 + 2 x (the attractor's median validation iterations, measured first) attention blocks:
                    Attractor's executed forward FLOPs per token
Each stack trains ``--steps`` steps of 8 x 64 tokens (one process, fp32), for each seed; validation
perplexity at the end, and for the attractor at evaluation depths 1, 2, 4 and its cap; iterations
(median in validation), executed training FLOPs per token, wall time.

    PYTHONPATH=. python experiments/attractor.py                 # 2 seeds, 100 steps (~20 min, 1 thread)
    PYTHONPATH=. python experiments/attractor.py --quick         # seconds: pipeline check
    PYTHONPATH=. python experiments/attractor.py --optimizer attractor --stacks attractor,params --seeds 1

``--optimizer attractor``: every stack trains with Attractor's MuonAdamW as configs/140m_attractor.yaml sets it
(issue 48; ``THEIR_OPTIMIZER``: their lr 8e-3 and betas, Muon with Keller's shape scale, polar express, NorMuon,
cautious decay 0.2 x shape scale to 0, momentum warm-up; the head in AdamW at lr x 0.5, its matrices decayed
0.1), under the experiment's warm-up and cosine schedule; the default trains with tiny_attractor's AdamW.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import QUICK_LM, Timer, parse_args, plot_val_curves, plt, save, table, train_lm  # noqa: E402

BLOCK = "mlp: relu2, qk_norm: true, init: scaled_zero_ortho"
CAP = 24          # configs/tiny_attractor.yaml's solver.max_iter


HEAD = "layers.3"  # tiny_attractor's attractor layer (3 attention blocks before it)
THEIR_OPTIMIZER = [
    "train.optimizer=muon_adamw", "train.lr=8e-3", "train.weight_decay=0.0", "train.beta1=0.8", "train.eps=1e-10",
    "train.muon.weight_decay=0.2", "train.muon.shape_scale=keller", "train.muon.ns_coefficients=polar_express",
    "train.muon.normuon=true", "train.muon.wd_scale=step", "train.muon.wd_schedule=linear",
    "train.muon.momentum_warmup=300", "train.lr_scale={matrix: 0.5, other: 0.5}",
    "train.group_weight_decay={matrix: 0.1}"]
HEAD_GROUPS = ["train.group_override={" + ", ".join(f"{HEAD}.{w}: matrix" for w in ("w_qkv", "w_o", "w_fc", "w_proj"))
               + f", {HEAD}.attn_norm: other, {HEAD}.mlp_norm: other}}"]


def attn_stack(blocks: int) -> list[str]:
    return [f"model.layers=[{{type: attn, repeat: {blocks}, {BLOCK}}}]"]


def recipe(steps: int, seed: int) -> list[str]:
    return [f"train.steps={steps}", "data.seq_len=64", "train.micro_batch=8", "train.global_batch=8",
            f"train.eval_interval={steps}", "train.eval_batches=8", "train.log_interval=10", "train.warmup=10",
            f"seed={seed}"]


def main():
    args = parse_args(__doc__, lambda p: (p.add_argument("--steps", type=int, default=100),
                                          p.add_argument("--seeds", type=int, default=2),
                                          p.add_argument("--optimizer", choices=("adamw", "attractor"),
                                                         default="adamw"),
                                          p.add_argument("--stacks", default="attractor,ratio,params,flops",
                                                         help="of attractor, ratio, params, flops")))
    stacks = args.stacks.split(",")
    optimizer = THEIR_OPTIMIZER if args.optimizer == "attractor" else []
    suffix = "" if args.optimizer == "adamw" else " [their optimizer]"
    seeds = [0] if args.quick else list(range(args.seeds))
    runs_dir = os.path.join(args.out, "runs")
    depths = [1, 2] if args.quick else [1, 2, 4, CAP]
    results: dict[str, list[dict]] = {}
    with Timer() as total:
        for seed in seeds:
            base = QUICK_LM + [f"seed={seed}"] if args.quick else recipe(args.steps, seed)
            reuse = not (args.fresh or args.quick)

            def run(name, over, eval_depths=()):
                print(f"== {name} seed {seed}", flush=True)
                tag = name.split(" ")[0] + "".join(c for c in name if c.isalnum())[-6:]
                tag += "_theirs" if optimizer else ""
                r = train_lm("tiny_attractor", over + optimizer + base, f"attractor_{tag}_s{seed}", runs_dir,
                             eval_depths=eval_depths, reuse=reuse, data=args.data)
                results.setdefault(name + suffix, []).append(r)
                return r

            iters = 4          # tiny_attractor's min_iter, where its trained solve stops (experiments/README.md)
            if "attractor" in stacks:
                att = run("attractor", HEAD_GROUPS if optimizer else [], depths)
                iters = max(1, round(next(iter(att["layers"].values()))["iters_median"]))
            if "ratio" in stacks:
                run("attn (their ratio)", attn_stack(2))
            if "params" in stacks:
                run("attn (= params)", attn_stack(5))
            if "flops" in stacks and not args.quick:
                run("attn (= FLOPs)", attn_stack(3 + 2 * iters))
    rows = []
    for name, rs in results.items():
        ppl = [r["val_ppl"] for r in rs]
        layers = [next(iter(r["layers"].values()))["iters_median"] for r in rs if r["layers"]]
        rows.append([name, f"{rs[0]['params'] / 1e6:.2f}M", len(rs), statistics.mean(ppl),
                     (max(ppl) - min(ppl)) / 2 if len(ppl) > 1 else 0.0,
                     f"{statistics.mean(layers):.1f}" if layers else "-",
                     f"{statistics.mean(r['flops_per_token_executed'] for r in rs) / 1e6:.2f}",
                     round(statistics.mean(r["wall_s"] for r in rs))])
    text = table(["stack", "params", "seeds", "val ppl (mean)", "half range", "median iterations (val)",
                  "executed MFLOP/token (train)", "wall s (mean)"], rows,
                 f"attractor vs attention, bundled corpus, {args.steps if not args.quick else 3} steps x 8 x 64 tokens")
    drows = [[f"attractor seed {i}"] + [f"{d['val_ppl']:.1f}" for d in r["depths"]]
             for i, r in enumerate(results.get("attractor" + suffix, []))]
    text += "\n" + table(["run"] + [f"depth {d}" for d in depths], drows,
                         "attractor: validation perplexity against the evaluation depth")
    print(f"total wall {total.s:.0f} s", flush=True)
    fig = plt().figure(figsize=(6, 3.6))
    plot_val_curves(fig.add_subplot(111), {f"{k} s{i}": r for k, rs in results.items() for i, r in enumerate(rs)},
                    fontsize=6)
    save(args, "attractor", {"table": text, "results": results, "depths": depths}, fig)


if __name__ == "__main__":
    main()
