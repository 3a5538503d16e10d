"""Seed 000 (FPSA), Sec. 3.1 and Fig. 2, scaled down: randomised induction with distractors (RID).
Each sequence holds a true pair (A, B) in its first half, K distractor pairs (A, D) with D != B after
it, and ends with the query A, MASK; the model must output B at MASK. Two stages:

1. The budget (``--stage budget``): attention 2L, the paper's minimal depth for induction, trains on the
   plain task (K = 0) at a constant learning rate, evaluated every 250 steps on 512 held-out sequences;
   the budget is the first step at 90% accuracy (``--max-steps`` caps it). ``--reference also`` (``only``) trains a
   plain torch.nn.TransformerEncoder of the same shape the same way: is a slow start fpscale's or the task's?
2. The sweep (``--stage sweep``, at the budget found or ``--budget N``): at d = 64, 4 heads,
     FPSA 1 layer (fpscale's fpsa block, the tiny_fpsa solver settings), judged per token (``halting: token``)
     and per token and head (``halting: head``, the paper's App. C.2, freezing in the adjoint too)
     FPSA-LH 1 layer (``fpsa_lh``: learned per-(token, head) halting, Sec. 4.5 / App. F, 12 steps at most)
     attention 1 layer, attention 2 layers
   trained on K in {0..4} at the same constant rate; tested on K = 0 .. 24 (Fig. 2b), and the mean
   attention entropy of the query position against the FPSA iteration (Fig. 2a; the attention layers'
   single pass beside it), and per head the histogram of the iterations each head ran at the query
   position (K = 4).

    PYTHONPATH=. python experiments/induction.py --stage budget [--reference also] [--max-steps N]
    PYTHONPATH=. python experiments/induction.py --stage sweep --budget N
    PYTHONPATH=. python experiments/induction.py             # both: the sweep at the budget found
    PYTHONPATH=. python experiments/induction.py --quick     # seconds: pipeline check

Scale-down (experiments/README.md): d 256 -> 64, FFN 1024 -> 171 (SwiGLU 8/3), length 32-256 -> 64, K <= 100 -> K <= 24,
FPSA tolerance 1e-4 with 100 iterations -> the shipped 2e-2 with 20 in training and 40 in evaluation (the
entropy probe iterates 40 times at tolerance 0). The paper states no training budget.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from experiments.common import Timer, eval_aligned, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402
from fpscale.data.synthetic import SyntheticTask  # noqa: E402

D, VOCAB, LENGTH = 64, 32, 64
FPSA_SOLVER = {"max_iter": 20, "eval_max_iter": 40, "tol": 2e-2, "stop_quantile": 0.25, "patience": 5,
               "decay": 0.7, "backward": "implicit", "backward_max_iter": 20, "backward_tol": 1e-3,
               "freeze_converged": True}
MODELS = {
    "FPSA 1L": [{"type": "fpsa"}],
    "FPSA 1L per head": [{"type": "fpsa", "halting": "head", "solver": {"backward_freeze": True}}],
    "FPSA-LH 1L": [{"type": "fpsa_lh", "max_steps": 12, "ponder_cost": 0.01}],
    "attention 1L": [{"type": "attn"}],
    "attention 2L": [{"type": "attn", "repeat": 2}],
}
TRAIN_K = [0, 1, 2, 3, 4]


class MixedK:
    """Training examples: sample i has K = TRAIN_K[i % 5] distractors (a pure function of (seed, i))."""

    def __init__(self, seed: int):
        self.tasks = [SyntheticTask("induction", VOCAB, LENGTH, seed, distractors=k) for k in TRAIN_K]

    def examples(self, indices):
        pairs = [self.tasks[i % len(self.tasks)].example(i) for i in indices]
        return (torch.tensor([p[0].tolist() for p in pairs]), torch.tensor([p[1].tolist() for p in pairs]))


class EntropyProbe:
    """Wraps the causal attention that fpscale's layers call, recording the mean attention entropy
    (nats, over heads and batch) of the last query position per call. Same output as SDPA."""

    def __init__(self):
        import fpscale.layers.common as common
        import fpscale.layers.fpsa as fpsa
        self.modules, self.orig, self.calls = (common, fpsa), common.causal_attention, []

    def __enter__(self):
        def recording(q, k, v, scale=None, dropout_p=0.0, pad=None):   # (no padding in the probe)
            dh = q.shape[-1]
            if isinstance(scale, torch.Tensor):
                q, scale = q * scale.view(1, -1, 1, 1).to(q.dtype), 1.0
            scale = dh ** -0.5 if scale is None else scale
            s = (q @ k.transpose(-1, -2)) * scale
            Tq, Tk = q.shape[-2], k.shape[-2]
            mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            last = p[:, :, -1]
            self.calls.append(float(-(last * last.clamp_min(1e-30).log()).sum(-1).mean()))
            return p @ v
        for m in self.modules:
            m.causal_attention = recording
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.causal_attention = self.orig


@torch.no_grad()
def head_iterations(model, task, n: int) -> dict[int, list[int]] | None:
    """Per head, the histogram (index: iterations) of the iterations it ran at the query position:
    FPSA's per-entry counts (with freezing), FPSA-LH's halting steps; None for the attention models."""
    model.eval()
    inputs, _ = task.examples(range(n))
    model(inputs)
    stats = next(iter(model.layer_stats().values()), None)
    if getattr(stats, "entry_iterations", None) is not None:          # fpsa: [B, T * H]
        counts = stats.entry_iterations.view(n, LENGTH, -1)[:, -1]
    elif hasattr(stats, "halt_step"):                                 # fpsa_lh: [B, H * T]
        counts = stats.halt_step.view(n, -1, LENGTH)[:, :, -1]
    else:
        return None
    return {h: torch.bincount(counts[:, h].long()).tolist() for h in range(counts.shape[1])}


@torch.no_grad()
def entropy_by_iteration(model, name: str, task, n: int, iters: int) -> list[float]:
    model.eval()
    inputs, _ = task.examples(range(n))
    if name.startswith("FPSA-LH"):       # its attention is its own (explicit), not the probed one
        return []
    if name.startswith("FPSA"):
        import dataclasses
        layer = next(iter(model.fixed_point_layers().values()))
        saved = layer.solver
        layer.solver = dataclasses.replace(saved, tol=0.0, freeze_converged=False)
        with EntropyProbe() as probe, model.eval_depth(iters):
            model(inputs)
        layer.solver = saved
        return probe.calls[:iters]
    with EntropyProbe() as probe:
        model(inputs)
    return probe.calls[-1:]           # the last layer's single pass


LEARNED, EVAL_EVERY = 0.9, 250     # "learns the plain task": held-out accuracy at K = 0, checked every 250 steps


class TorchReference(torch.nn.Module):
    """A plain torch.nn.TransformerEncoder (pre-norm, GELU MLP 4d, learned positions, causal) of the
    attention 2L shape, with the few methods the training and evaluation helpers call."""

    def __init__(self, n_layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(LENGTH, D)
        layer = torch.nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm, self.out = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB)
        self.last_losses: dict = {}

    def forward(self, inputs, targets=None):
        T = inputs.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(T)
        logits = self.out(self.norm(self.encoder(self.embed(inputs) + self.pos(torch.arange(T)), mask=mask,
                                                 is_causal=True)))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def set_step(self, step):
        pass

    def solver_stats(self):
        return {}

    def layer_stats(self):
        return {}

    def eval_depth(self, depth):
        return contextlib.nullcontext()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def shortcut_accuracy(task, n: int) -> float:
    """The accuracy of reading positions only, no induction: B sits at an odd position of the first half
    (slot < slots // 2, as ``SyntheticTask`` places it), so guess the commonest token at those positions
    other than the query A (ties split evenly). What a model that has not learnt induction can reach."""
    inputs, targets = task.examples(range(n))
    T = inputs.shape[1]
    first = ((T - 2) // 2) // 2                      # the true pair's slots: 0 .. first - 1
    total = 0.0
    for seq, target in zip(inputs, targets[:, -1]):
        counts = torch.bincount(seq[1:2 * first:2], minlength=VOCAB)
        counts[seq[-2]] = 0
        best = (counts == counts.max()).nonzero().flatten()
        total += float((best == target).any()) / len(best)
    return total / n


def find_budget(args, batch: int, lr: float, max_steps: int, n_eval: int, eval_every: int) -> dict:
    """Attention 2L (and with ``--reference`` the torch.nn one) on the plain task at a constant rate
    after warm-up: the first step whose held-out accuracy reaches LEARNED, or None within max_steps."""
    runs = {"attention 2L": lambda: small_model(VOCAB, D, MODELS["attention 2L"], FPSA_SOLVER, max_seq_len=LENGTH,
                                                seed=0)[0], "torch.nn TransformerEncoder 2L": TorchReference}
    runs = {n: b for n, b in runs.items() if args.reference != ("only" if n == "attention 2L" else "no")}
    held = SyntheticTask("induction", VOCAB, LENGTH, 50_000, distractors=0)
    out = {}
    for name, build in runs.items():
        model, evals = build(), []

        def check(step, model=model, evals=evals):
            evals.append((step, eval_aligned(model, held, n_eval, batch=min(n_eval, 256))["last_acc"]))
            print(f"  {name} step {step}: held-out accuracy {evals[-1][1]:.3f}", flush=True)
            return evals[-1][1] >= LEARNED

        with Timer() as t:
            curve = train_aligned(model, SyntheticTask("induction", VOCAB, LENGTH, 1, distractors=0), max_steps,
                                  batch, lr, warmup=min(100, max_steps // 4 + 1), min_lr=lr, log_every=eval_every,
                                  label=name, on_log=check)
        learned = next((s for s, a in evals if a >= LEARNED), None)
        out[name] = {"params": model.num_params(), "learned_at": learned, "train_s": t.s, "curve": curve,
                     "held_out": evals, "sequences": (learned or evals[-1][0]) * batch}
    return out


def main():
    args = parse_args(__doc__, lambda p: (
        p.add_argument("--stage", choices=("all", "budget", "sweep"), default="all"),
        p.add_argument("--budget", type=int, default=None, help="the sweep's steps (default: the budget found)"),
        p.add_argument("--max-steps", type=int, default=16_000, help="the budget stage's cap"),
        p.add_argument("--reference", choices=("no", "also", "only"), default="no",
                       help="the budget stage also (or only) trains torch.nn's 2L")))
    if args.stage == "sweep" and not (args.budget or args.quick):
        raise SystemExit("--stage sweep needs --budget N (the steps to train each model)")
    batch, n_eval, lr = (16, 32, 1e-3) if args.quick else (64, 512, 1e-3)
    max_steps, eval_every = (3, 1) if args.quick else (args.max_steps, EVAL_EVERY)
    ks = [0, 4, 24] if args.quick else [0, 2, 4, 8, 12, 16, 24]
    steps = 3 if args.quick else args.budget
    if args.stage in ("all", "budget") and not (args.stage == "all" and args.budget):
        with Timer() as total:
            found = find_budget(args, batch, lr, max_steps, n_eval, eval_every)
        marks = [s for s, _ in next(iter(found.values()))["held_out"]][::max(1, 2000 // eval_every)]
        shortcut = shortcut_accuracy(SyntheticTask("induction", VOCAB, LENGTH, 50_000, distractors=0), n_eval)
        text = table(["model", "params", "learned at step", "sequences seen"] +
                     [f"acc@{m}" for m in marks] + ["train s"],
                     [[n, r["params"], r["learned_at"] or f"not by {r['held_out'][-1][0]}", r["sequences"]] +
                      [dict(r["held_out"]).get(m, "") for m in marks] + [round(r["train_s"])]
                      for n, r in found.items()] +
                     [["position shortcut (no model)", 0, "-", "-"] + [shortcut] * len(marks) + [0]],
                     f"the budget: plain induction (K = 0, length {LENGTH}), batch {batch}, lr {lr} constant; "
                     f"learned = {LEARNED:.0%} held-out accuracy")
        save(args, "induction_budget", {"settings": {"d_model": D, "vocab": VOCAB, "length": LENGTH, "batch": batch,
                                                     "lr": lr, "max_steps": max_steps, "learned": LEARNED,
                                                     "eval_every": eval_every},
                                        "models": found, "shortcut_acc": shortcut, "wall_s": total.s,
                                        "table": text})
        steps = steps or found.get("attention 2L", {}).get("learned_at") or (max_steps if args.quick else None)
    if args.stage == "budget":
        return
    if not steps:
        print(f"attention 2L did not learn the plain task within {max_steps} steps: no budget, no sweep "
              "(raise --max-steps, or give --budget)", flush=True)
        return
    results = {"settings": {"d_model": D, "vocab": VOCAB, "length": LENGTH, "train_k": TRAIN_K, "steps": steps,
                            "batch": batch, "lr": lr, "fpsa_solver": FPSA_SOLVER}, "models": {}}
    with Timer() as total:
        for name, layers in MODELS.items():
            model, _ = small_model(VOCAB, D, layers, FPSA_SOLVER, max_seq_len=LENGTH, seed=0)
            with Timer() as t:
                curve = train_aligned(model, MixedK(seed=1), steps, batch, lr, warmup=min(100, steps // 4 + 1),
                                      min_lr=lr, log_every=max(1, steps // 6), label=name)
            r = {"params": model.num_params(), "train_s": t.s, "curve": curve, "by_k": {}}
            for k in ks:
                ev = eval_aligned(model, SyntheticTask("induction", VOCAB, LENGTH, 50_000 + k, distractors=k),
                                  n_eval, batch=min(n_eval, 256))
                r["by_k"][k] = {"acc": ev["last_acc"], "iters": (sorted(ev["iters"])[len(ev["iters"]) // 2]
                                                                 if ev["iters"] else 1)}
            r["entropy"] = entropy_by_iteration(model, name, SyntheticTask("induction", VOCAB, LENGTH, 60_000,
                                                                           distractors=4), min(n_eval, 128),
                                                8 if args.quick else 40)
            r["head_iterations"] = head_iterations(model, SyntheticTask("induction", VOCAB, LENGTH, 60_000,
                                                                        distractors=4), min(n_eval, 128))
            results["models"][name] = r
    rows = [[name, r["params"]] + [r["by_k"][k]["acc"] for k in ks] + [round(r["train_s"])]
            for name, r in results["models"].items()]
    text = table(["model", "params"] + [f"K={k}" for k in ks] + ["train s"], rows,
                 f"RID accuracy against the number of distractors K (length {LENGTH}, trained on K <= 4; "
                 f"chance ~{1 / (VOCAB - 1):.2f})")
    fp = results["models"]["FPSA 1L"]
    looped = [n for n in results["models"] if n.startswith("FPSA")]
    text += "\n" + table(["model"] + [f"K={k}" for k in ks],
                         [[n] + [results["models"][n]["by_k"][k]["iters"] for k in ks] for n in looped],
                         "FPSA median evaluation iterations against K (FPSA-LH: steps its loop ran)")
    hist_rows = [[n, h, sum(i * c for i, c in enumerate(hist)) / max(sum(hist), 1),
                  max(i for i, c in enumerate(hist) if c)]
                 for n in looped if results["models"][n]["head_iterations"]
                 for h, hist in results["models"][n]["head_iterations"].items()]
    text += "\n" + table(["model", "head", "mean iterations", "max"], hist_rows,
                         "iterations per head at the query position, K = 4 (histograms in the JSON)")
    ent = fp["entropy"]
    show = [i for i in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40) if i <= len(ent)]
    text += "\n" + table(["model"] + [f"iter {i}" for i in show],
                         [["FPSA 1L"] + [ent[i - 1] for i in show]] +
                         [[n, results["models"][n]["entropy"][0]] + [""] * (len(show) - 1)
                          for n in ("attention 1L", "attention 2L")],
                         f"attention entropy of the query position (nats; uniform over {LENGTH} keys = "
                         f"{math.log(LENGTH):.2f}), K = 4")
    print(f"total wall {total.s:.0f} s", flush=True)
    results["wall_s"] = total.s
    fig = plt().figure(figsize=(9, 3.6))
    ax = fig.add_subplot(121)
    for name in ("attention 1L", "attention 2L"):
        ax.axhline(results["models"][name]["entropy"][0], ls="--", label=name, color="C1" if "1L" in name else "C2")
    ax.plot(range(1, len(ent) + 1), ent, marker=".", label="FPSA 1L", color="C0")
    ax.set_xlabel("FPSA iteration"), ax.set_ylabel("attention entropy (nats)"), ax.legend(fontsize=7)
    ax = fig.add_subplot(122)
    for name, r in results["models"].items():
        ax.plot(ks, [r["by_k"][k]["acc"] for k in ks], marker="o", label=name)
    ax.set_xlabel("distractors K"), ax.set_ylabel("accuracy"), ax.set_ylim(0, 1.02), ax.legend(fontsize=7)
    save(args, "induction", {**results, "table": text}, fig)


if __name__ == "__main__":
    main()
