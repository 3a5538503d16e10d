"""Evaluate a checkpoint of any layout on any layout (one CPU process included).

    python launch/evaluate.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300
    torchrun --nproc_per_node 2 launch/evaluate.py --checkpoint DIR --tp 2

The checkpoint is consolidated to whole weights (DeepSpeed's universal checkpoint, converted once
by rank 0), built into a plain model, loaded, then split for this run's layout by ``parallelize``;
the validation batches are the training run's. Writes ``eval.json`` (loss, perplexity, per-layer
iteration statistics) and ``iterations.png`` (iterations per fixed-point layer) into ``--out``;
with ``depths``, also one record per evaluation depth (eval.json's ``depths``) and ``depth.png``
(loss and iterations against depth).

Precision: by default the run's ``train.precision`` (bf16 autocast for a bf16 run, TF32 matmuls for
an fp32 run on CUDA), through the same context as training-time validation
(fpscale.train.precision), so the losses and iteration counts are the ones training reported, and
the solver's tolerances are floored alike (fpscale.solvers.precision: the map's dtype decides).
``precision`` asks for another: ``fp32``, ``bf16`` or ``fp32-strict`` (IEEE fp32, TF32 off).
"""
from __future__ import annotations

import json
import os

from fpscale.parallel.parallelize import parallelize
from fpscale.train import checkpoint
from fpscale.train.build import build_datasets
from fpscale.train.precision import autocast, eval_precision, set_matmul_precision
from fpscale.train.validation import validate, validate_depths


def evaluate_checkpoint(folder: str, state, out_dir: str, eval_batches: int | None = None,
                        depths: list[int] | None = None, precision: str = "config") -> dict:
    """Validate ``folder`` on this layout and write the report into ``out_dir`` (main rank).
    The top-level fields are the run at the configured ``solver.forward.eval_max_iter``; ``depths``
    (e.g. [1, 2, 4, 8]) adds ``report["depths"]``, one record per depth, and ``depth.png``.
    ``precision``: ``config`` (the run's ``train.precision``), ``fp32``, ``bf16`` or
    ``fp32-strict``; the report's ``precision`` says which ran.

        report = evaluate_checkpoint("runs/x/checkpoints/step_00000300", state, "out", depths=[1, 4, 16])
        [(r["depth"], r["val_loss"]) for r in report["depths"]]
    """
    eval_precision(precision, "fp32")                       # a bad value fails before any work
    problem = checkpoint.verify_together(folder, state)     # every rank hashes a share
    if problem:
        raise checkpoint.CheckpointError(f"cannot evaluate {folder}: {problem}")
    model, cfg = checkpoint.load_model(folder, state)
    model = parallelize(model, state).to(state.device)
    _, val = build_datasets(cfg)
    t = cfg.train
    precision = eval_precision(precision, t.precision)
    set_matmul_precision(precision, state.device)

    def context():
        return autocast(precision, state.device)

    batches = eval_batches or t.eval_batches
    result = validate(model, model, val, t.micro_batch, batches, state, context, progress=True)
    if depths:
        result["depths"] = validate_depths(model, model, val, t.micro_batch, batches, depths, state, context,
                                           progress=True)
    meta = checkpoint.read_meta(folder)
    report = {"checkpoint": os.path.abspath(folder), "step": meta["step"],
              "saved_layout": {"tp": meta["tp"], "dp": meta["dp"], "zero_stage": meta["zero_stage"]},
              "eval_layout": {"tp": state.tp_size, "dp": state.dp_size}, "precision": precision, **result}
    if state.is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "eval.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        plot_iterations(report, os.path.join(out_dir, "iterations.png"))
        if depths:
            plot_depths(report, os.path.join(out_dir, "depth.png"))
    return report


def plot_iterations(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = report["layers"]
    names = list(layers)
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names) + 2), 3.5))
    if names:
        x = range(len(names))
        ax.bar(x, [layers[n]["iters_mean"] for n in names], color="#4c72b0", label="mean")
        ax.scatter(x, [layers[n]["iters_p90"] for n in names], color="#dd8452", zorder=3, label="p90")
        ax.scatter(x, [layers[n]["iters_max"] for n in names], color="#c44e52", marker="^", zorder=3, label="max")
        ax.set_xticks(list(x), names, rotation=20, ha="right")
        ax.legend(frameon=False)
    else:
        ax.text(0.5, 0.5, "no fixed-point layers", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("solver iterations")
    ax.set_title(f"step {report['step']}: val loss {report['val_loss']:.4f}, ppl {report['val_ppl']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_depths(report: dict, path: str) -> None:
    """Test-time compute scaling of ``report["depths"]``: validation loss (left axis) and the mean
    iterations of each looped layer (right axis) against the evaluation depth (log2 axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = sorted(report["depths"], key=lambda r: r["depth"])
    depths = [r["depth"] for r in records]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(depths, [r["val_loss"] for r in records], "o-", color="#4c72b0", lw=2, label="validation loss")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("evaluation depth (solver iteration cap)")
    ax.set_ylabel("validation loss", color="#4c72b0")
    lines = ax.get_lines()
    names = list(records[0]["layers"]) if records else []
    if names:
        right = ax.twinx()
        for i, name in enumerate(names):
            lines += right.plot(depths, [r["layers"][name]["iters_mean"] for r in records], "s--", ms=4, lw=1,
                                color=plt.cm.Dark2(i % 8), label=f"{name} iterations")
        right.set_ylabel("mean solver iterations")
    fig.legend(lines, [line.get_label() for line in lines], frameon=False, fontsize=8, loc="lower center",
               ncol=min(len(lines), 3))
    ax.set_title(f"step {report['step']}: test-time compute")
    fig.tight_layout(rect=(0, 0.06 * ((len(lines) + 2) // 3) + 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
