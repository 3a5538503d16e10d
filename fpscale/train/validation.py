"""Validation loss, perplexity and per-layer solver statistics on the fixed validation batches,
at the configured evaluation cap (``validate``) or once per evaluation depth (``validate_depths``);
shared by the trainer and launch/evaluate.py."""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from fpscale.data.loader import validation_batches
from fpscale.solvers.stats import as_dicts
from fpscale.train.metrics import perplexity, summarize_layers


def validate(forward, model, dataset, micro_batch: int, num_batches: int, state,
             autocast=contextlib.nullcontext, progress: bool = False) -> dict:
    """``forward(inputs, targets=...)`` is the model or its DeepSpeed engine. Every DP rank
    evaluates whole batches (the same batches on any layout), all ranks the same number of
    forwards (``validation_batches``), and the sums are all-reduced.

    A blend's validation (``dataset.parts``: [(name, weight, dataset)], fpscale/data/blend.py) runs
    ``num_batches`` on each source: ``val_loss_<name>`` and ``val_ppl_<name>`` per source, and
    ``val_loss`` the weight-averaged loss of the sources (its ``layers``: all sources' forwards)."""
    parts = getattr(dataset, "parts", None)
    if parts is None:
        out, _ = _validate(forward, model, dataset, micro_batch, num_batches, state, autocast, progress)
        return out
    out, rows, loss = {}, {}, 0.0
    for name, weight, part in parts:
        one, part_rows = _validate(forward, model, part, micro_batch, num_batches, state, autocast, progress)
        out[f"val_loss_{name}"], out[f"val_ppl_{name}"] = one["val_loss"], one["val_ppl"]
        loss += weight * one["val_loss"]
        for layer, r in part_rows.items():
            rows.setdefault(layer, []).extend(r)
    return {"val_loss": loss, "val_ppl": perplexity(loss), "layers": summarize_layers(rows), **out}


@torch.no_grad()
def _validate(forward, model, dataset, micro_batch: int, num_batches: int, state, autocast,
              progress: bool) -> tuple[dict, dict[str, list[dict]]]:
    """One dataset's validation record and its per-layer rows."""
    model.eval()
    batches = validation_batches(dataset, micro_batch, num_batches, state.dp_rank, state.dp_size)
    if progress and state.is_main and sys.stderr.isatty():       # a bar for people, not for log files
        from tqdm import tqdm
        batches = tqdm(batches, desc="validation", unit="batch", leave=False, dynamic_ncols=True)
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    count, layer_stats = 0, {}
    for batch, counted in batches:
        batch = batch.to(state.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast():
            loss = forward(inputs, targets=targets)
        if not counted:            # a turn without a batch: the forward only keeps ZeRO-3's gathers in step
            continue
        total += loss.detach().double() * batch.shape[0]
        count += batch.shape[0]
        for name, stats in model.layer_stats().items():      # device tensors, read once at the end
            layer_stats.setdefault(name, []).append(stats)
    sums = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=state.device)])
    if state.distributed:
        dist.all_reduce(sums, group=state.dp_group)
    total, count = sums.tolist()            # the loss: one host synchronisation
    layer_stats = as_dicts(layer_stats)     # every layer's statistics of every batch: one more
    loss = total / count
    return {"val_loss": loss, "val_ppl": perplexity(loss), "layers": summarize_layers(layer_stats)}, layer_stats


def validate_depths(forward, model, dataset, micro_batch: int, num_batches: int, depths, state,
                    autocast=contextlib.nullcontext, progress: bool = False) -> list[dict]:
    """The validation of :func:`validate` once per evaluation depth, every looped layer capped at
    that many solver iterations (``model.eval_depth``): test-time compute scaling.

        validate_depths(model, model, val, 8, 8, [1, 2, 4, 8], state)
        # -> [{"depth": 1, "val_loss": ..., "val_ppl": ..., "layers": {...}}, ...]

    ``model`` is the LoopedLM module (under DeepSpeed ``forward`` is the engine around it). Every
    DP rank must pass the same depths in the same order: each depth all-reduces its sums."""
    records = []
    for depth in depths:
        with model.eval_depth(int(depth)):
            out = validate(forward, model, dataset, micro_batch, num_batches, state, autocast, progress)
        records.append({"depth": int(depth), **out})
    return records


def depth_scalars(records: list[dict]) -> dict[str, float]:
    """Flat scalars of a depth sweep for metrics.jsonl / TensorBoard: ``{"val_loss_depth_8": ...,
    "val_ppl_depth_8": ..., "val_iters_mean_depth_8": ...}`` (iterations averaged over the looped layers)."""
    out = {}
    for r in records:
        d, layers = r["depth"], r["layers"].values()
        out[f"val_loss_depth_{d}"], out[f"val_ppl_depth_{d}"] = r["val_loss"], r["val_ppl"]
        if layers:
            out[f"val_iters_mean_depth_{d}"] = sum(st["iters_mean"] for st in layers) / len(layers)
    return out


def validation_lines(record: dict) -> list[str]:
    """The console report of a validation record: loss and perplexity, each looped layer's
    iterations, and the depth sweep when there is one."""
    lines = [f"validation at step {record['step']}: loss {record['val_loss']:.4f} ppl {record['val_ppl']:.2f}"]
    for name, st in record["layers"].items():
        if "depth_mean" in st:            # a halting layer: expected depth per token, steps run
            lines.append(f"  {name:<18} depth mean {st['depth_mean']:.2f} p50 {st['depth_p50']:.2f} "
                         f"p90 {st['depth_p90']:.2f}  steps mean {st['iters_mean']:.2f} max {st['iters_max']:.0f}  "
                         f"kl {st['kl']:.3f}")
            continue
        lines.append(f"  {name:<18} iterations mean {st['iters_mean']:.2f} median {st['iters_median']:.0f} "
                     f"p90 {st['iters_p90']:.0f} max {st['iters_max']:.0f}  converged "
                     f"{st['converged_fraction']:.0%}  residual p50 {st['residual_p50']:.1e}")
    for r in record.get("depths", []):
        iters = " ".join(f"{name.split('.')[-1]}{name.split('.')[1]}:{st['iters_mean']:.1f}"
                         for name, st in r["layers"].items())
        lines.append(f"  depth {r['depth']:>4}: loss {r['val_loss']:.4f} ppl {r['val_ppl']:.2f}"
                     f"{'  iters ' + iters if iters else ''}")
    return lines
