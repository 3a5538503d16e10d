"""What one solve did: iterations, residuals, convergence, damping. Cheap to build.

The tensors stay on the device until ``to_dict`` is called, so collecting statistics adds
no host synchronisation to the solve itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STOP_REASONS = ("converged", "quantile", "max_iter", "eta_min", "nonfinite")


@dataclass
class SolverStats:
    iterations: int                 # applications of f in the forward solve
    max_iter: int                   # the cap it ran under (may be randomised per step)
    stopped_by: str                 # one of STOP_REASONS
    sample_residual: torch.Tensor   # [B] final relative residual per sample (float32)
    token_converged: torch.Tensor   # [B, T] bool: token residual < tol at the end
    final_eta: torch.Tensor         # [B] damping factor per sample when the solve ended
    tol: float                      # the tolerance applied (raised to the dtype's floor in bf16)
    backward_iterations: int | None = None   # adjoint iterations (implicit), set during backward
    backward_residual: float | None = None

    @property
    def nonfinite(self) -> bool:
        return self.stopped_by == "nonfinite"

    def to_dict(self) -> dict:
        r = self.sample_residual.float()
        finite = r[torch.isfinite(r)]
        q = (torch.quantile(finite, torch.tensor([0.5, 0.9], dtype=finite.dtype, device=finite.device)).tolist()
             if finite.numel() else [float("nan"), float("nan")])
        out = {
            "iterations": self.iterations,
            "max_iter": self.max_iter,
            "stopped_by": self.stopped_by,
            "residual_p50": q[0],
            "residual_p90": q[1],
            "residual_max": float(r.max()) if r.numel() else float("nan"),
            "converged_fraction": float((r < self.tol).float().mean()) if r.numel() else 1.0,
            "token_converged_fraction": float(self.token_converged.float().mean()),
            "eta": float(self.final_eta.float().mean()),
            "eta_lowest": float(self.final_eta.min()),
            "nonfinite": self.nonfinite,
        }
        if self.backward_iterations is not None:
            out["backward_iterations"] = self.backward_iterations
            out["backward_residual"] = self.backward_residual
        return out
