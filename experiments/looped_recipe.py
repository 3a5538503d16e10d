"""Why is tiny_looped worse than the two attention blocks it replaces? An ablation of the looped
core's recipe on the bundled corpus (tiny_looped: attn -> FPRM core of 2 blocks -> attn, 300 steps
x 16 x 128 tokens, one process), one factor at a time from the shipped recipe:

  residual scalings at initialisation (a1, a2), the randomised training cap, the backward mode
  (phantom k = 2, k = 4, implicit), and the core's share of the input at initialisation.

    PYTHONPATH=. python experiments/looped_recipe.py            # full: 11 runs, ~40 min on 2 cores
    PYTHONPATH=. python experiments/looped_recipe.py --only 'shipped;a1=0.9'
    PYTHONPATH=. python experiments/looped_recipe.py --quick    # seconds: pipeline check

Also measured at initialisation (no training): how much of the core's output s* is the input x
(cosine of s* with x, and a1^L, the factor a pass applies to its input).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from experiments.common import QUICK_LM, parse_args, plot_val_curves, plt, save, table, train_lm  # noqa: E402

CORE = "model.layers.1"
BASE = [f"{CORE}.a1_init=0.5", f"{CORE}.a2_init=0.5"]      # the core's scalings before issue #17
VARIANTS = {      # name -> overrides of configs/tiny_looped.yaml after BASE, in order of priority
    "shipped": [],                                          # a1 = a2 = 0.5
    "a1=0.9": [f"{CORE}.a1_init=0.9"],
    "no cap": ["model.iteration_cap.dist=none"],
    "a1=0.75": [f"{CORE}.a1_init=0.75"],
    "a2=0.9": [f"{CORE}.a2_init=0.9"],
    "phantom k=4": ["solver.adjoint.phantom_steps=4"],
    "a1=0.9,a2=0.9": [f"{CORE}.a1_init=0.9", f"{CORE}.a2_init=0.9"],
    "shipped, seed 2": ["seed=2"],
    "a1=0.75, seed 2": [f"{CORE}.a1_init=0.75", "seed=2"],
    "a1=0.9, seed 2": [f"{CORE}.a1_init=0.9", "seed=2"],
    "implicit, no cap": ["solver.backward=implicit", "solver.backward_tol=1e-3", "solver.backward_max_iter=20",
                         "model.iteration_cap.dist=none"],
}


@torch.no_grad()
def input_share(a1: float, a2: float, seed: int = 0) -> dict:
    """At initialisation: cosine between the core's output s* and its input x, per token, averaged."""
    import fpscale
    cfg = fpscale.load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           "configs/tiny_looped.yaml"),
                              [f"{CORE}.a1_init={a1}", f"{CORE}.a2_init={a2}"])
    torch.manual_seed(seed)
    model = fpscale.build_model(cfg).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 128), generator=torch.Generator().manual_seed(seed))
    x = model.layers[0](model.embed(tokens))
    s = model.layers[1](x)
    cos = torch.nn.functional.cosine_similarity(s, x, dim=-1).mean()
    L = 2 * cfg.model.layers[1].core_blocks
    return {"a1": a1, "a2": a2, "a1^L": a1 ** L, "cos(s*, x)": float(cos),
            "rms s*/rms x": float(s.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())}


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--only", default="", help="variant names separated by ;"))
    names = list(VARIANTS) if not args.only else [n.strip() for n in args.only.split(";")]
    steps = QUICK_LM if args.quick else []
    if args.quick:
        names = names[:1]
    inits = ((0.5, 0.5),) if args.quick else ((0.5, 0.5), (0.75, 0.5), (0.9, 0.5), (0.9, 0.9))
    init_rows = [input_share(a1, a2) for a1, a2 in inits]
    table(list(init_rows[0]), [list(r.values()) for r in init_rows], "at initialisation (tiny_looped)")
    runs = {}
    runs_dir = os.path.join(args.out, "runs")
    for name in names:
        print(f"== {name}", flush=True)
        runs[name] = train_lm("tiny_looped", BASE + VARIANTS[name] + steps, "looped_" + name.replace(" ", "_")
                              .replace(",", "_").replace("=", ""), runs_dir,
                              reuse=not (args.fresh or args.quick), data=args.data)
    rows = []
    for name, r in runs.items():
        core = r["layers"].get("layers.1.looped", {})
        sc = r["scalings"].get("layers.1.looped", {})
        loss100 = next((l for s, l in r["val_curve"] if s == 100), float("nan"))
        rows.append([name, " ".join(VARIANTS[name]) or "-", r["params"], loss100, r["val_loss"], r["val_ppl"],
                     core.get("iters_median", float("nan")), sc.get("a1", float("nan")), sc.get("a2", float("nan")),
                     round(r["wall_s"])])
    text = table(["variant", "overrides", "params", "val loss @100", "val loss", "val ppl", "median iters (val)",
                  "a1 end", "a2 end", "wall s"], rows, "tiny_looped recipe ablation (one process)")
    fig = plt().figure(figsize=(7, 4))
    ax = fig.add_subplot(111)
    plot_val_curves(ax, runs)
    ax.set_title("tiny_looped: recipe ablation")
    save(args, "looped_recipe", {"init": init_rows, "runs": runs, "table": text}, fig)


if __name__ == "__main__":
    main()
