"""Every layer type on language (epsilon too): the bundled corpus (SOTU + python3.11-doc, 8000-piece BPE), the
shipped tiny configs (d 128, 300 steps x 16 x 128 tokens, one process), at about equal parameters
and equal tokens. Per stack: validation perplexity at step 300, executed and nominal training FLOPs
per token, median solver iterations in validation, wall time; and, for every stack with a looped
layer, validation perplexity against the evaluation depth (every looped layer capped at d
iterations: test-time compute).

    PYTHONPATH=. python experiments/language.py                       # all (~30 min, --threads 1, 2 shared cores)
    PYTHONPATH=. python experiments/language.py --stacks attn,looped  # some of them
    PYTHONPATH=. python experiments/language.py --quick               # seconds: pipeline check

Each stack is a separate Trainer run kept in experiments/results/runs (reused when the resolved config
is the same; --fresh retrains).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import QUICK_LM, Timer, parse_args, plot_val_curves, plt, save, table, train_lm  # noqa: E402

STACKS = {     # name -> (config, overrides)
    "attn": ("tiny_attn", []),
    "fpsa": ("tiny_fpsa", []),
    "looped": ("tiny_looped", []),
    "fpmamba": ("tiny_fpmamba", []),
    "mamba (mixer none, 1 iteration)": ("tiny_fpmamba", ["model.layers.0.mixer=none", "model.layers.0.y_feedback=false",
                                                          "solver.max_iter=1", "solver.eval_max_iter=1"]),
    "mixed": ("tiny_mixed", []),
    "mixed, looped a1 = 0.75": ("tiny_mixed", ["model.layers.3.a1_init=0.75"]),
    "epsilon": ("tiny_epsilon", []),      # seed 003 in the same prelude / coda stack (1.63M parameters)
}
DEPTHS = [1, 2, 4, 8, 16, 32]
SHORT = {"mamba (mixer none, 1 iteration)": "mamba", "mixed, looped a1 = 0.75": "mixed_a075"}


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--stacks", default="", help="comma-separated: " + ", ".join(
        SHORT.get(k, k) for k in STACKS)))
    names = list(STACKS)
    if args.stacks:
        want = [w.strip() for w in args.stacks.split(",")]
        names = [n for n in STACKS if n in want or SHORT.get(n) in want]
    quick = QUICK_LM if args.quick else []
    depths = [1, 2] if args.quick else DEPTHS
    if args.quick:
        names = [n for n in names if n in ("attn", "looped")]
    runs_dir = os.path.join(args.out, "runs")
    results = {}
    with Timer() as total:
        for name in names:
            config, over = STACKS[name]
            print(f"== {name}: {config} {' '.join(over)}", flush=True)
            has_loop = name != "attn" and not name.startswith("mamba")
            results[name] = train_lm(config, over + quick, f"lang_{SHORT.get(name, name)}", runs_dir,
                                     eval_depths=depths if has_loop else (), reuse=not (args.fresh or args.quick),
                                     data=args.data)
    rows = []
    for name, r in results.items():
        iters = " ".join(f"{k.split('.')[-1]}{k.split('.')[1]}:{v['iters_median']:.0f}" for k, v in r["layers"].items())
        emb = 8000 * 128 if not args.quick else 0
        rows.append([name, f"{r['params'] / 1e6:.2f}M", f"{(r['params'] - emb) / 1e6:.2f}M", r["val_loss"],
                     r["val_ppl"], f"{r['flops_per_token_executed'] / 1e6:.1f}",
                     f"{r['flops_per_token_nominal'] / 1e6:.1f}", iters or "-", round(r["wall_s"])])
    text = table(["stack", "params", "non-embedding", "val loss", "val ppl", "executed MFLOP/token (train)",
                  "nominal MFLOP/token", "median iterations (val)", "wall s"], rows,
                 "language, bundled corpus, 300 steps x 16 x 128 tokens (one process)")
    drows = []
    for name, r in results.items():
        if r.get("depths"):
            drows.append([name] + [f"{d['val_ppl']:.1f}" for d in r["depths"]])
    if drows:
        text += "\n" + table(["stack"] + [f"depth {d}" for d in depths], drows,
                             "validation perplexity against the evaluation depth (iteration cap of every looped layer)")
    print(f"total wall {total.s:.0f} s (kept runs reused: their own wall times are in the table)", flush=True)
    fig = plt().figure(figsize=(9, 3.6))
    ax = fig.add_subplot(121)
    plot_val_curves(ax, results, fontsize=6)
    ax = fig.add_subplot(122)
    for name, r in results.items():
        if r.get("depths"):
            ax.plot([d["depth"] for d in r["depths"]], [d["val_ppl"] for d in r["depths"]], marker="o", label=name)
    ax.set_xscale("log", base=2), ax.set_xlabel("evaluation depth"), ax.set_ylabel("validation perplexity")
    ax.legend(fontsize=6)
    save(args, "language", {"stacks": results, "depths": depths, "table": text, "wall_s": total.s}, fig)


if __name__ == "__main__":
    main()
