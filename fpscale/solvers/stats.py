"""What one solve did: iterations, residuals, convergence, damping. Cheap to build.

The tensors stay on the device until they are read: ``to_dict`` reads one object's in one
host synchronisation, ``to_dicts`` reads a whole list of statistics objects (every layer's, every
micro-batch's of a log interval) in one synchronisation for all of them. An object that takes
part provides ``summary()`` (a 1-D tensor of every number its dictionary needs) and
``from_summary(values)`` (the dictionary from those numbers, read back as a list of floats).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STOP_REASONS = ("converged", "quantile", "max_iter", "eta_min", "nonfinite")


def to_dicts(rows: list) -> list[dict]:
    """``[s.to_dict() for s in rows]`` with one host read for all of them: the ``summary()`` of
    every object that has one is concatenated (in float64, on the first one's device) and read
    with a single ``.tolist()``; an object without ``summary`` falls back to its ``to_dict``."""
    parts = [s.summary() for s in rows if hasattr(s, "summary")]
    if not parts:
        return [s.to_dict() for s in rows]
    device = parts[0].device
    values = torch.cat([p.to(device=device, dtype=torch.float64) for p in parts]).tolist()
    out, at, it = [], 0, iter(parts)
    for s in rows:
        if not hasattr(s, "summary"):
            out.append(s.to_dict())
            continue
        n = next(it).numel()
        out.append(s.from_summary(values[at:at + n]))
        at += n
    return out


@dataclass
class SolverStats:
    iterations: int                 # applications of f in the forward solve
    max_iter: int                   # the cap it ran under (may be randomised per step)
    stopped_by: str                 # one of STOP_REASONS
    sample_residual: torch.Tensor   # [B] final relative residual per sample (float32)
    token_converged: torch.Tensor   # [B, T] bool: token residual < tol at the end
    final_eta: torch.Tensor         # [B, T] per token ([B] per sample) damping when the solve ended
    tol: float                      # the tolerance applied (raised to the dtype's floor in bf16)
    backward_iterations: int | None = None   # adjoint iterations (implicit), set during backward
    backward_residual: torch.Tensor | float | None = None   # adjoint's largest residual (a device scalar)
    windows: int | None = None      # deep supervision: windows supervised before the final one
    retired_at: torch.Tensor | None = None   # [B] long: the iteration the last token retired (decisions: token)
    window: int | None = None       # deep supervision: iterations per window
    entry_iterations: torch.Tensor | None = None   # [B, T] int32: iterations that changed each entry (count_entries)
    # rows f computed, summed over the loop's iterations: B x iterations, less where the eager loop compacted
    # the batch's rows (fpscale.solvers.rows; the applications after the loop are not counted)
    row_iterations: int | None = None

    @property
    def nonfinite(self) -> bool:
        return self.stopped_by == "nonfinite"

    def summary(self) -> torch.Tensor:
        """[p50, p90, max, converged fraction, token converged fraction, eta mean, eta lowest,
        (backward residual)] on the device, float64 (the statistics are computed in float32)."""
        r = self.sample_residual.float()
        dev = r.device
        if r.numel():
            # quantiles of the finite residuals (NaN when none is finite), without a data-dependent
            # shape: masking them out would make the device report how many there are
            q = torch.nanquantile(torch.where(torch.isfinite(r), r, float("nan")),
                                  torch.tensor([0.5, 0.9], dtype=r.dtype, device=dev))
            parts = [q, r.max().view(1), (r < self.tol).float().mean().view(1)]
        else:
            parts = [torch.full((3,), float("nan"), device=dev), torch.ones(1, device=dev)]
        parts += [self.token_converged.float().mean().view(1), self.final_eta.float().mean().view(1),
                  self.final_eta.min().view(1)]
        if self.backward_iterations is not None:
            parts.append(torch.as_tensor(self.backward_residual, dtype=torch.float64).to(dev).view(1))
        return torch.cat([p.to(torch.float64) for p in parts])

    def from_summary(self, values: list[float]) -> dict:
        out = {
            "iterations": self.iterations,
            "max_iter": self.max_iter,
            "stopped_by": self.stopped_by,
            "residual_p50": values[0],
            "residual_p90": values[1],
            "residual_max": values[2],
            "converged_fraction": values[3],
            "token_converged_fraction": values[4],
            "eta": values[5],
            "eta_lowest": values[6],
            "nonfinite": self.nonfinite,
        }
        if self.backward_iterations is not None:
            out["backward_iterations"] = self.backward_iterations
            out["backward_residual"] = values[7]
        if self.windows is not None:
            out["windows"], out["window"] = self.windows, self.window
        return out

    def to_dict(self) -> dict:
        """The statistics as host numbers, in one synchronisation."""
        return self.from_summary(self.summary().tolist())


def as_dicts(window: dict[str, list]) -> dict[str, list[dict]]:
    """Every layer's statistics ({layer: [stats per forward]}, a log interval's or a validation's) as
    dictionaries, read from the device in one synchronisation for all of them (``to_dicts``)."""
    names = list(window)
    flat = to_dicts([s for name in names for s in window[name]])
    out, at = {}, 0
    for name in names:
        out[name], at = flat[at:at + len(window[name])], at + len(window[name])
    return out
