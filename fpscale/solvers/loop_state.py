"""What the two solver loops share (the PyTorch loop in fpscale.solvers.iterate and the fused one in
fpscale.solvers.fused): the state dtype, the check of f's output, and what a loop returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the solver keeps its iterate, residuals and damping in: float64 stays, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_step_output(fz, z: torch.Tensor) -> None:
    """f(z) must be a tensor shaped like z (checked at the first iteration)."""
    if not isinstance(fz, torch.Tensor) or fz.shape != z.shape:
        got = tuple(fz.shape) if isinstance(fz, torch.Tensor) else type(fz).__name__
        raise ValueError(f"solve: f(z) must return a tensor shaped like z {tuple(z.shape)}, got {got}")


def entry_changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """[B, T] int32: 1 where an entry's value differs between two iterates ([B, T, ...])."""
    return (new != old).reshape(*new.shape[:2], -1).any(-1).int()


@dataclass
class Carry:
    """Algorithm 1's per-sample state where one call of ``iterate`` ends and the next goes on with
    the same solve (deep supervision's windows, fpscale.layers.deep_supervision): damping, best
    residual, patience left, frozen tokens and the residuals they keep."""
    eta: torch.Tensor             # [B]
    best: torch.Tensor            # [B]
    patience_left: torch.Tensor   # [B] long
    frozen: torch.Tensor          # [B, T] bool
    token_res: torch.Tensor       # [B, T]


NEVER = 2 ** 62      # ``IterateResult.retired_at`` of a last token that never retired


@dataclass
class IterateResult:
    z: torch.Tensor               # the last iterate, in the solver's state dtype
    iterations: int
    stopped_by: str
    token_res: torch.Tensor       # [B, T] residual of the last evaluated step
    token_converged: torch.Tensor  # [B, T] bool
    eta: torch.Tensor             # [B] damping per sample when the solve ended
    carry: Carry | None = None    # the state a next call goes on from (the PyTorch loops)
    retired_at: torch.Tensor | None = None   # [B] long: the iteration the last token retired (per token)
    entry_iters: torch.Tensor | None = None  # [B, T] int32: iterations that changed each entry (count_entries)
    row_iterations: int | None = None   # f's rows summed over the loop's calls, where counted (fpscale.solvers.rows)
