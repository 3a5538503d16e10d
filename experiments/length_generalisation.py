"""Seed 004 (FPRM), Fig. 3 at CPU scale: length generalisation on the A5 word problem. Train at length 32,
evaluate at lengths 16-128 with the evaluation cap raised; FPRM against looped transformers of a fixed depth.

  FPRM       fpscale's looped core: pre-norm with residual scaling (Theorem 1's a1, b1, a2, b2), the causal
             conv on the re-injected input (Table 6: conv1d k = 4), deep supervision in windows of 4
             (``deep_supervision.window``, Algorithm 2), fixed-point halting (tol 0.1, p = 0.25, Algorithm 1's
             patience), phantom k = 4 (Table 6's n_back); cap 32 in training, 128 in evaluation
  pre-norm   the same weights' shapes looped at a fixed depth without scaling: z <- z + f(z) per
             sublayer, z_{i+1}^0 = z_i^L + x (a Universal Transformer)
  post-norm  z <- RMSNorm(z + g(z)) per sublayer (g: the sublayer without its input norm), z_{i+1}^0 =
             z_i^L + x; fixed depth
The baselines train and evaluate at DEPTH loops, backpropagating through all of them (unroll).

    PYTHONPATH=. python experiments/length_generalisation.py            # full: A5, ~25 min on the shared 2 cores
    PYTHONPATH=. python experiments/length_generalisation.py --group s3  # the same on S3
    PYTHONPATH=. python experiments/length_generalisation.py --quick    # seconds: pipeline check

Scale-down (experiments/README.md): paper trains FPRM 20 epochs of global batch 1024 at lr 1e-3 (Table 6; the data set
size is not stated) with 2 layers of the TRM width (hidden 512); here each model gets STEPS x BATCH words
(the full setting: 600 x 32 = 19,200) at d_model 64, lr 3e-3 warm-up 50 then cosine; the evaluation cap 128
(paper 256), training cap 32 (paper 128). Accuracy at length n: the state after all n elements (the last
position) on 128 fresh words of length n; iterations: the median over the evaluation batches of the solver's
iterations (fixed: DEPTH for the baselines).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.common import Timer, eval_aligned, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402
from fpscale.data.synthetic import SyntheticTask, group_elements  # noqa: E402
from fpscale.layers.common import rms_norm, self_attention, swiglu  # noqa: E402
from fpscale.layers.looped import LoopedCore  # noqa: E402

D, TRAIN_LEN, DEPTH = 64, 32, 8
LENGTHS = [16, 24, 32, 48, 64, 96, 128]
FPRM_SOLVER = {"max_iter": 32, "eval_max_iter": 128, "tol": 0.1, "stop_quantile": 0.25, "patience": 3, "decay": 0.5,
               "eta_min": 0.05, "backward": "phantom", "phantom_steps": 4}
FIXED_SOLVER = {"max_iter": DEPTH, "eval_max_iter": DEPTH, "tol": 0.0, "patience": 0, "eta_min": 0.0,
                "backward": "unroll"}


class PreNormLoop(LoopedCore):
    """A Universal Transformer pass: z <- z + f(z) per pre-norm sublayer; the input re-injected by addition."""

    def scalings(self):
        one = torch.ones_like(self.a1_logit, dtype=torch.float32)
        return one, one, one, one            # a1 = b1 = a2 = b2 = 1: no scaling


class PostNormLoop(LoopedCore):
    """z <- RMSNorm(z + g(z)) per sublayer, g without its input norm; the input re-injected by addition."""

    scalings = PreNormLoop.scalings

    def one_pass(self, z, cos, sin, caches, collect=None, pad=None):
        for l in range(self.blocks):
            out, _, _ = self_attention(z.to(self.w_qkv.dtype), self.w_qkv[l], self.w_o[l], self.head_dim, cos, sin,
                                       None, pad=pad)
            z = rms_norm(z + out, self.attn_norm[l], self.eps).float()
            z = rms_norm(z + swiglu(z.to(self.w_gate.dtype), self.w_gate[l], self.w_up[l], self.w_down[l]),
                         self.mlp_norm[l], self.eps).float()
        return z


MODELS = {     # name -> (layer spec, solver, class of the core)
    "FPRM (pre-norm + scaling, DS, fixed-point halting)": (
        {"type": "looped", "core_blocks": 2, "conv": True, "deep_supervision": {"window": 4}}, FPRM_SOLVER, None),
    f"pre-norm looped, depth {DEPTH}": ({"type": "looped", "core_blocks": 2}, FIXED_SOLVER, PreNormLoop),
    f"post-norm looped, depth {DEPTH}": ({"type": "looped", "core_blocks": 2}, FIXED_SOLVER, PostNormLoop),
}


def run_one(group: str, name: str, spec: dict, solver: dict, cls, steps: int, batch: int, lr: float, n_eval: int,
            lengths: list[int]) -> dict:
    vocab = len(group_elements(group))
    model, _ = small_model(vocab, D, [spec], solver, max_seq_len=max(lengths))
    if cls is not None:
        model.layers[0].__class__ = cls
    task = SyntheticTask(group, vocab, TRAIN_LEN, seed=1)
    with Timer() as t:
        curve = train_aligned(model, task, steps, batch, lr, warmup=min(50, steps // 4 + 1),
                              log_every=max(1, steps // 6), label=f"{group} {name[:12]}")
    out = {"params": model.num_params(), "train_s": t.s, "curve": curve, "by_length": {}}
    with Timer() as e:
        for n in lengths:
            ev = eval_aligned(model, SyntheticTask(group, vocab, n, seed=10_000 + n), n_eval, batch=min(n_eval, 64))
            out["by_length"][n] = {"last_acc": ev["last_acc"], "token_acc": ev["token_acc"],
                                   "iters": float(np.median(ev["iters"])) if ev["iters"] else float("nan")}
            print(f"  {name[:12]} length {n}: last {ev['last_acc']:.3f} token {ev['token_acc']:.3f} "
                  f"iters {out['by_length'][n]['iters']}", flush=True)
    out["eval_s"] = e.s
    return out


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--group", default="a5", help="s3, a4 or a5"))
    if args.quick:
        steps, batch, n_eval, lengths = 2, 4, 8, [16, 32]
    else:
        steps, batch, n_eval, lengths = 600, 32, 128, LENGTHS
    lr, group = 3e-3, args.group
    results = {"settings": {"group": group, "d_model": D, "train_len": TRAIN_LEN, "depth": DEPTH, "steps": steps,
                            "batch": batch, "lr": lr, "fprm_solver": FPRM_SOLVER, "lengths": lengths}, "runs": {}}
    with Timer() as total:
        for name, (spec, solver, cls) in MODELS.items():
            print(f"== {group} {name}", flush=True)
            results["runs"][name] = run_one(group, name, spec, solver, cls, steps, batch, lr, n_eval, lengths)
    rows = [[name, r["params"]] + [r["by_length"][n]["last_acc"] for n in lengths] + [round(r["train_s"])]
            for name, r in results["runs"].items()]
    text = table(["model", "params"] + [f"acc@{n}" for n in lengths] + ["train s"], rows,
                 f"{group.upper()}: accuracy of the state after n elements (trained at n = {TRAIN_LEN})")
    iters = [[name] + [r["by_length"][n]["iters"] for n in lengths] for name, r in results["runs"].items()]
    text += "\n" + table(["model"] + [f"iters@{n}" for n in lengths], iters,
                         "median iterations in evaluation against the length (FPRM: cap 128)")
    print(f"total wall {total.s:.0f} s", flush=True)
    results["wall_s"], results["table"] = total.s, text
    fig = plt().figure(figsize=(9, 3.6))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, r in results["runs"].items():
        ax1.plot(lengths, [r["by_length"][n]["last_acc"] for n in lengths], marker=".", label=name)
        ax2.plot(lengths, [r["by_length"][n]["iters"] for n in lengths], marker=".", label=name)
    for ax in (ax1, ax2):
        ax.axvline(TRAIN_LEN, color="pink", ls="--"), ax.set_xlabel("length")
    ax1.set_ylabel("accuracy"), ax1.set_ylim(0, 1.02), ax1.legend(fontsize=6), ax2.set_ylabel("iterations")
    ax1.set_title(f"{group.upper()}: trained at {TRAIN_LEN}")
    save(args, "length_generalisation", results, fig)


if __name__ == "__main__":
    main()
