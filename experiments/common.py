"""Shared helpers of the experiments: threads, output paths, tables, JSON/PNG, language training
through fpscale's Trainer, and a small training loop for the synthetic tasks (position-aligned
targets, which the LM trainer's next-token shift does not express).

Every experiment prints a table, writes ``experiments/results/<name>.json`` and ``<name>.png``
and has a ``--quick`` setting (seconds: checks the pipeline, not the result)."""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from typing import Callable, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")


def parse_args(doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="seconds-long pipeline check (CI), not the result")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--out", default=RESULTS, help="folder for the JSON and PNG")
    p.add_argument("--fresh", action="store_true", help="retrain runs whose results are kept in <out>/runs")
    p.add_argument("--data", default=os.path.join(ROOT, "cache/corpus/tokens"),
                   help="prepared token shards for the language runs (default: the bundled corpus)")
    if extra:
        extra(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*stop_quantile.*")
    return args


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A Markdown table (also what stdout shows)."""
    def fmt(v):
        if isinstance(v, float):
            if v != v:
                return "nan"
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)
    lines = ([f"\n{title}\n"] if title else []) + ["| " + " | ".join(headers) + " |",
                                                   "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save(args, name: str, payload: dict, figure=None) -> None:
    payload = {"experiment": name, "quick": bool(args.quick), **payload}
    path = os.path.join(args.out, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, default=float)
    print(f"wrote {path}", flush=True)
    if figure is not None:
        png = os.path.join(args.out, f"{name}.png")
        figure.tight_layout()
        figure.savefig(png, dpi=110)
        print(f"wrote {png}", flush=True)


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


# -- language: fpscale's Trainer in one process ------------------------------------------------
# what --quick trains (seconds): a few steps of short sequences
QUICK_LM = ["train.steps=3", "train.eval_interval=3", "train.eval_batches=1", "train.log_interval=3", "train.warmup=1",
            "train.micro_batch=4", "train.global_batch=4", "data.seq_len=32"]

LAYER_FIELDS = {"all": ["type", "repeat", "solver"], "attn": [], "fpsa": ["spectral_norm", "temperature"],
                "fpmamba": ["mixer", "mixer_rank", "negative_eigs", "d_state", "expand", "d_conv", "y_feedback"],
                "looped": ["core_blocks", "a1_init", "a2_init", "conv"],
                "fpmamba2": None}    # None: every field (a type added after the runs kept so far)
# keys added after runs were kept: left out of the key at their default (kept runs stay reusable)
NEW_KEY_DEFAULTS = {("fpsa", "halting"): "token", ("attn", "mlp"): "swiglu", ("attn", "qk_norm"): False,
                    ("attn", "init"): "fpscale", ("attn", "value_embed"): False}


def run_key(cfg) -> str:
    """A hash of the resolved config, without where the run is written: the same model, data and
    recipe give the same key (so a kept run is reused only for exactly that setting)."""
    import hashlib

    from fpscale.config import config_to_dict
    d = config_to_dict(cfg)
    d.pop("name", None)
    from fpscale.layers.fpmamba import DEFAULTS as FPMAMBA_DEFAULTS
    for spec in d["model"]["layers"]:            # only the fields the layer type reads
        fields = LAYER_FIELDS.get(spec["type"])
        if fields is None:                       # a type not listed (epsilon, fpsa_lh, fpmamba2): every field
            continue
        keep = LAYER_FIELDS["all"] + fields
        if (spec.get("deep_supervision") or {}).get("window"):   # on: part of the key (off: as before it existed)
            keep = keep + ["deep_supervision"]
        for k in [k for k in spec if k not in keep]:
            # fpmamba's preset and switches (issue 28) count only where they differ from fpscale's
            # defaults: the runs kept before them keep their keys
            if spec["type"] == "fpmamba" and ((k == "preset" and spec[k] != "none") or
                                              (k in FPMAMBA_DEFAULTS and spec[k] != FPMAMBA_DEFAULTS[k])):
                continue
            if spec[k] != NEW_KEY_DEFAULTS.get((spec["type"], k), spec[k]):
                continue                         # a key added later, away from its default: it counts
            spec.pop(k)
    for k in ("out_dir", "resume", "eval_depths"):
        d["train"].pop(k, None)
    from fpscale.train.optim_config import MuonConfig
    from fpscale.typed import to_dict
    # train keys added after runs were kept (issue 37): left out at their defaults
    for k, default in (("optimizer", "adamw"), ("schedule", "cosine"), ("decay_fraction", 0.2),
                       ("decay_shape", "linear"), ("lr_scale", {}), ("group_weight_decay", {}), ("group_betas", {}),
                       ("group_override", {}), ("muon", to_dict(MuonConfig()))):
        if d["train"].get(k) == default:
            d["train"].pop(k)
    d["data"].pop("path", None)
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def find_kept(out_dir: str, key: str) -> dict | None:
    if not os.path.isdir(out_dir):
        return None
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".result.json"):
            with open(os.path.join(out_dir, f)) as fh:
                out = json.load(fh)
            if out.get("key") == key:
                print(f"reusing {f} (same resolved config; --fresh to retrain)", flush=True)
                return out
    return None


def depth_sweep(trainer, depths: Sequence[int]) -> list[dict]:
    """Validation once per evaluation depth on the trained model (fpscale.train.validation.validate_depths)."""
    from fpscale.train.validation import validate_depths
    t = trainer.cfg.train
    return validate_depths(trainer.model, trainer.model, trainer.val_ds, t.micro_batch, t.eval_batches,
                           list(depths), trainer.state)


def depth_sweep_from_weights(cfg, weights: str, depths: Sequence[int]) -> list[dict]:
    """The depth sweep of a finished run, from its exported weights (runs/<name>/final)."""
    from fpscale.parallel.state import ParallelState
    from fpscale.train.build import build_datasets
    from fpscale.train.checkpoint import load_model
    from fpscale.train.validation import validate_depths
    model, _ = load_model(weights, cfg=cfg)
    _, val = build_datasets(cfg)
    t = cfg.train
    return validate_depths(model, model, val, t.micro_batch, t.eval_batches, list(depths), ParallelState())


def train_lm(config: str, overrides: Sequence[str], name: str, out_dir: str, eval_depths: Sequence[int] = (),
             reuse: bool = False, data: str = os.path.join(ROOT, "cache/corpus/tokens")) -> dict:
    """Train ``configs/<config>.yaml`` with ``overrides`` through fpscale.train.Trainer (one
    process) and return {val_loss, val_ppl, layers, history, params, wall_s, flops...}, also kept in
    ``out_dir/<name>.result.json``; with ``reuse`` a kept run of the same resolved config
    (:func:`run_key`) is returned."""
    import fpscale
    from fpscale.train.trainer import Trainer
    path = config if config.endswith(".yaml") else os.path.join(ROOT, "configs", f"{config}.yaml")
    over = [f"name={name}", f"train.out_dir={out_dir}", "train.resume=none",
            f"data.path={data}", *overrides]
    cfg = fpscale.load_config(path, over)
    key = run_key(cfg)
    if reuse:
        kept = find_kept(out_dir, key)
        if kept is not None:
            if eval_depths and [r["depth"] for r in kept.get("depths", [])] != list(eval_depths):
                kept["depths"] = depth_sweep_from_weights(cfg, os.path.join(out_dir, kept["run"], "final"),
                                                          eval_depths)
                with open(os.path.join(out_dir, f"{kept['run']}.result.json"), "w") as fh:
                    json.dump(kept, fh, default=float)
            return kept
    with Timer() as t:
        trainer = Trainer(cfg, log=True)
        history = trainer.train()
    vals = [r for r in history if r.get("kind") == "val"]
    trains = [r for r in history if r.get("kind") == "train"]
    last_val, last_train = vals[-1], trains[-1]
    scal = {}
    for name_, m in trainer.model.fixed_point_layers().items():
        if hasattr(m, "scalings"):
            a1, b1, a2, b2 = (float(v.detach()) for v in m.scalings())
            scal[name_] = {"a1": a1, "b1": b1, "a2": a2, "b2": b2}
    depths = depth_sweep(trainer, eval_depths) if eval_depths else []
    out = {"config": config, "overrides": list(overrides), "key": key, "run": name,
           "params": trainer.model.num_params(),
            "val_loss": last_val["val_loss"], "val_ppl": last_val["val_ppl"], "layers": last_val["layers"],
            "depths": depths, "wall_s": t.s,
            "val_curve": [(r["step"], r["val_loss"]) for r in vals],
            "train_curve": [(r["step"], r["loss"]) for r in trains],
            "flops_per_token_nominal": last_train["flops_per_token_nominal"],
            "flops_per_token_executed": last_train["flops_per_token_executed"],
            "train_layers": last_train["layers"], "scalings": scal, "threads": torch.get_num_threads()}
    with open(os.path.join(out_dir, f"{name}.result.json"), "w") as fh:
        json.dump(out, fh, default=float)
    return out


# -- synthetic, position-aligned tasks: a small loop over fpscale's model and optimizer ----------
def small_model(vocab: int, d_model: int, layers: list[dict], solver: dict | None = None, n_heads: int = 4,
                max_seq_len: int = 128, seed: int = 0, iteration_cap: dict | None = None):
    """fpscale.build_model on a Config built from ``layers`` (LayerSpec dicts) and ``solver``."""
    import fpscale
    data = {"seed": seed, "model": {"vocab_size": vocab, "d_model": d_model, "n_heads": n_heads,
                                    "max_seq_len": max_seq_len, "layers": layers,
                                    "iteration_cap": iteration_cap or {"dist": "none"}},
            "solver": solver or {}, "train": {"micro_batch": 64, "global_batch": 64},
            "data": {"source": "synthetic", "seq_len": max_seq_len}}
    from fpscale.config import config_from_dict
    cfg = config_from_dict(data)
    torch.manual_seed(seed)
    return fpscale.build_model(cfg), cfg


def train_aligned(model, task, steps: int, batch: int, lr: float, warmup: int = 50, weight_decay: float = 0.01,
                  grad_clip: float = 1.0, log_every: int = 100, label: str = "", min_lr: float | None = None,
                  on_log: Callable[[int], bool] | None = None) -> list[tuple[int, float]]:
    """Train on ``task.examples`` (sample indices step*batch ...): AdamW (fpscale.train.optim), linear
    warm-up then cosine to ``min_lr`` (lr/10 unless given; ``min_lr=lr``: constant), the randomised
    caps drawn per step (model.set_step). ``on_log(step)`` runs at every log step; True stops training
    there. Returns [(step, loss)]."""
    from fpscale.train.optim import AdamW
    from fpscale.train.schedule import lr_at
    from fpscale.train.trainer import param_groups
    opt = AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95))
    curve, window = [], []
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        model.set_step(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, lr / 10 if min_lr is None else min_lr, warmup, steps)
        inputs, targets = task.examples(range(step * batch, (step + 1) * batch))
        loss = model(inputs, targets=targets)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.skip_next = not math.isfinite(float(gn))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the cross-entropy (with deep supervision the loss minimised also sums the windows' losses)
        window.append(float(model.last_losses.get("ce", loss).detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append((step + 1, sum(window) / len(window)))
            iters = {k.split(".")[-1]: v.iterations for k, v in model.solver_stats().items()}
            print(f"  {label} step {step + 1}/{steps} loss {curve[-1][1]:.4f} iters {iters} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            window = []
            if on_log is not None and on_log(step + 1):
                break
    return curve


@torch.no_grad()
def eval_aligned(model, task, n: int, batch: int = 128, depth: int | None = None) -> dict:
    """Accuracy on ``n`` examples of ``task`` (evaluation mode, every looped layer capped at
    ``depth``): ``token_acc`` over scored targets, ``last_acc`` at each example's last scored
    target, ``iters`` [per batch, the largest iteration count (or halting steps run) of any looped layer]."""
    model.eval()
    right = total = last_right = 0
    iters = []
    with model.eval_depth(depth):
        for start in range(0, n, batch):
            inputs, targets = task.examples(range(start, min(n, start + batch)))
            pred = model(inputs).argmax(-1)
            scored = targets != -100
            right += int(((pred == targets) & scored).sum())
            total += int(scored.sum())
            last = scored.long().cumsum(1).argmax(1)             # position of the last scored target
            rows = torch.arange(len(targets))
            last_right += int((pred[rows, last] == targets[rows, last]).sum())
            stats = model.layer_stats()          # solves and halting loops
            if stats:
                iters.append(max(s.iterations for s in stats.values()))
    model.train()
    return {"token_acc": right / max(total, 1), "last_acc": last_right / n, "iters": iters}


def plot_val_curves(ax, runs: dict[str, dict], fontsize: int = 7) -> None:
    """Validation loss against the step of every ``train_lm`` result in ``runs``, one line each."""
    for name, r in runs.items():
        steps, losses = zip(*r["val_curve"])
        ax.plot(steps, losses, marker="o", label=name)
    ax.set_xlabel("step"), ax.set_ylabel("validation loss"), ax.legend(fontsize=fontsize)
