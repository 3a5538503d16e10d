"""Data-parallel imbalance of the looped layers, logged at each log step.

Each data-parallel rank stops its solves on its own micro-batch (``solver.forward.agree: rank``, the
default), and every optimizer step waits for the rank with the most work. At a log step the
iteration counts of the interval (every looped layer, every micro-batch, forward and adjoint) are
gathered over the DP group in one collective and reported per layer as

  iters_dp_max, iters_dp_mean     the max and the mean over DP ranks of the layer's forward
                                  iterations, averaged over the interval's micro-batches
  backward_iters_dp_max, _mean    the same for the adjoint solve (implicit backward)

and for the whole model ``dp_wait_est``: per step, 1 - mean / max over ranks of the step's looped
iterations (forward + adjoint, all layers), averaged over the interval: the share of its looped-layer
time the average rank spends waiting for the slowest, if every iteration costs the same (an
estimate from counts, device-independent; a rank's wall time is not measured, which on a GPU would
need a synchronisation). With ``solver.forward.agree: dp`` every rank runs the same iterations: 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def dp_imbalance(rows: dict[str, list[dict]], per_step: int, state) -> tuple[dict[str, dict], float | None]:
    """({layer: {iters_dp_max, iters_dp_mean, ...}}, dp_wait_est) of a log interval's statistics
    (``rows``: as_dicts of the window, ``per_step`` micro-batches a step); ({}, None) without DP.
    Every DP rank must call it at the same log step (one all_gather over the DP group)."""
    names = [n for n in rows if rows[n] and "iterations" in rows[n][0] and rows[n][0].get("kind") != "halting"]
    if state.dp_size <= 1 or not state.distributed or not names:
        return {}, None
    fwd = [[r["iterations"] for r in rows[n]] for n in names]
    bwd = [[r.get("backward_iterations") or 0 for r in rows[n]] for n in names]
    mine = torch.tensor([fwd, bwd], dtype=torch.float64, device=state.device)   # [2, layers, micro-batches]
    gathered = [torch.empty_like(mine) for _ in range(state.dp_size)]
    dist.all_gather(gathered, mine, group=state.dp_group)
    every = torch.stack(gathered).cpu()                                    # [ranks, 2, layers, micro]
    out = {}
    for i, name in enumerate(names):
        out[name] = {"iters_dp_max": float(every[:, 0, i].amax(0).mean()),
                     "iters_dp_mean": float(every[:, 0, i].mean())}
        if any(r.get("backward_iterations") is not None for r in rows[name]):
            out[name].update(backward_iters_dp_max=float(every[:, 1, i].amax(0).mean()),
                             backward_iters_dp_mean=float(every[:, 1, i].mean()))
    work = every.sum(dim=(1, 2))                                           # [ranks, micro-batches]
    steps = work.shape[1] // max(per_step, 1)
    per_step_work = work[:, :steps * per_step].reshape(work.shape[0], steps, per_step).sum(-1)   # [ranks, steps]
    peak = per_step_work.amax(0)
    wait = torch.where(peak > 0, 1 - per_step_work.mean(0) / peak.clamp_min(1e-30), torch.zeros_like(peak))
    return out, float(wait.mean()) if steps else 0.0
