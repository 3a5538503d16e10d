"""The fixed-point iteration shared by the forward solve and the adjoint solve.

One loop, one host synchronisation per iteration (the stop decision):
  residual per token    r_t = ||f(z)_t - z_t|| / (||f(z)_t|| + eps)     (inf or l2 norm)
  residual per sample   r_b = max_t r_t
  quantile stop         stop once #(r_b >= tol) < p * B   (p = 0: once every sample converged)
  damped step           z <- eta f(z) + (1 - eta) z   (or Anderson mixing with weight eta)
  patience              eta <- decay * eta after `patience` steps without a new best max_b r_b
  safeguards            cap, eta < eta_min, non-finite residual (the last finite z is kept)
  freezing              a converged token is frozen: its value never changes again
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fpscale.solvers.config import SolverConfig

# A consensus callable takes a small int64 tensor of flags and returns their element-wise
# maximum over a process group, so every rank of that group takes the same decision.
Consensus = Callable[[torch.Tensor], torch.Tensor]
# A state reduction completes per-token partial norms when the iterate itself is split over a
# process group (tensor-parallel channels): (tensor, "sum" | "max") -> the group's total.
StateReduce = Callable[[torch.Tensor, str], torch.Tensor]


def token_residual(new: torch.Tensor, old: torch.Tensor, norm: str, eps: float,
                   state_reduce: StateReduce | None = None) -> torch.Tensor:
    """Relative change per token: [B, T, ...] -> [B, T] (float32 or float64)."""
    dtype = torch.float64 if new.dtype == torch.float64 else torch.float32
    diff = (new - old).to(dtype).flatten(2) if new.dim() > 2 else (new - old).to(dtype).unsqueeze(-1)
    ref = new.to(dtype).flatten(2) if new.dim() > 2 else new.to(dtype).unsqueeze(-1)
    if norm == "inf":
        parts = torch.stack([diff.abs().amax(-1), ref.abs().amax(-1)])
        if state_reduce is not None:
            parts = state_reduce(parts, "max")
        return parts[0] / (parts[1] + eps)
    if state_reduce is None:
        return torch.linalg.vector_norm(diff, dim=-1) / (torch.linalg.vector_norm(ref, dim=-1) + eps)
    sq = state_reduce(torch.stack([diff.pow(2).sum(-1), ref.pow(2).sum(-1)]), "sum").sqrt()
    return sq[0] / (sq[1] + eps)


def _per_token(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [B, T] mask against a [B, T, ...] tensor."""
    return mask.view(*mask.shape, *([1] * (like.dim() - 2)))


class _Anderson:
    """Type-II Anderson mixing per sample over a window of m past (z, f(z)) pairs."""

    def __init__(self, window: int, lam: float, state_reduce: StateReduce | None = None):
        self.window, self.lam, self.state_reduce = window, lam, state_reduce
        self.xs: list[torch.Tensor] = []
        self.fs: list[torch.Tensor] = []

    def step(self, z: torch.Tensor, fz: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
        self.xs.append(z.flatten(1))
        self.fs.append(fz.flatten(1))
        if len(self.xs) > self.window:
            self.xs.pop(0)
            self.fs.pop(0)
        n = len(self.xs)
        if n == 1:
            return eta * fz + (1 - eta) * z
        X, F = torch.stack(self.xs, 1), torch.stack(self.fs, 1)          # [B, n, D]
        G = (F - X).double()
        B = X.shape[0]
        H = torch.zeros(B, n + 1, n + 1, dtype=torch.float64, device=z.device)
        H[:, 0, 1:] = H[:, 1:, 0] = 1
        gram = G @ G.transpose(1, 2)
        if self.state_reduce is not None:     # the state is split over ranks: sum the partial Gram
            gram = self.state_reduce(gram, "sum")
        scale = gram.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)[:, None, None]
        H[:, 1:, 1:] = gram + self.lam * scale * torch.eye(n, dtype=torch.float64, device=z.device)
        rhs = torch.zeros(B, n + 1, 1, dtype=torch.float64, device=z.device)
        rhs[:, 0] = 1
        alpha = torch.linalg.solve(H, rhs)[:, 1:, 0].to(z.dtype)[:, None]   # [B, 1, n]
        mixed = eta * (alpha @ F)[:, 0] + (1 - eta) * (alpha @ X)[:, 0]
        return mixed.view_as(z)


@dataclass
class IterateResult:
    z: torch.Tensor
    iterations: int
    stopped_by: str
    token_res: torch.Tensor       # [B, T] residual of the last evaluated step
    token_converged: torch.Tensor  # [B, T] bool
    eta: torch.Tensor


def iterate(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig,
            *, quantile: float, consensus: Consensus | None = None,
            state_reduce: StateReduce | None = None, max_iter: int | None = None) -> IterateResult:
    """Run the damped fixed-point iteration of ``step`` from ``z0``.

    Gradients flow through the loop only if grad mode is on (the ``unroll`` backward);
    the stop decision always uses detached values. ``state_reduce`` is given when ``z`` is
    this rank's slice of a state split over a group (norms and Anderson's Gram are completed).
    """
    max_iter = cfg.max_iter if max_iter is None else max_iter
    B = z0.shape[0]
    dev = z0.device
    z = z0
    eta = torch.tensor(cfg.damping, dtype=torch.float64, device=dev)
    best = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    patience_left = torch.tensor(cfg.patience, device=dev)
    frozen = torch.zeros(z0.shape[:2], dtype=torch.bool, device=dev)
    token_res = torch.full(z0.shape[:2], float("inf"), device=dev)
    anderson = _Anderson(cfg.anderson, cfg.anderson_lambda, state_reduce) if cfg.anderson else None
    limit = quantile * B
    stopped_by = "max_iter"
    k = 0
    for k in range(1, max_iter + 1):
        fz = step(z)
        if k == 1 and (not isinstance(fz, torch.Tensor) or fz.shape != z.shape):
            got = tuple(fz.shape) if isinstance(fz, torch.Tensor) else type(fz).__name__
            raise ValueError(f"solve: f(z) must return a tensor shaped like z {tuple(z.shape)}, got {got}")
        with torch.no_grad():
            res = token_residual(fz.detach(), z.detach(), cfg.norm, cfg.eps, state_reduce)
            res = torch.where(frozen, token_res.to(res.dtype), res)
            sample_res = res.amax(1)
            finite = torch.isfinite(sample_res)
            unconverged = (~(sample_res < cfg.tol)).sum()
            converged_rule = (unconverged == 0) | (unconverged < limit)
            # Algorithm 1: progress resets the patience, stagnation decays eta.
            r = torch.where(finite, sample_res, torch.full_like(sample_res, float("inf"))).amax().double()
            improved = r < best
            best = torch.where(improved, r, best)
            if cfg.patience > 0:
                patience_left = torch.where(improved, cfg.patience, patience_left - 1)
                decay_now = patience_left <= 0
                next_eta = torch.where(decay_now, eta * cfg.decay, eta)
                patience_left = torch.where(decay_now, cfg.patience, patience_left)
            else:
                next_eta = eta
            eta_small = next_eta < cfg.eta_min
            flags = torch.stack([converged_rule, eta_small, ~finite.all()]).long()
            if consensus is not None:
                agreed = consensus(torch.stack([1 - (flags[0] | flags[1]), flags[2]]))
                flags = torch.cat([flags, agreed])
            host = flags.tolist()
        nonfinite = bool(host[2]) if consensus is None else bool(host[4])
        if nonfinite:
            stopped_by = "nonfinite"
            break   # keep the last finite iterate z
        step_eta = eta.to(z.dtype)
        z_next = anderson.step(z, fz, step_eta) if anderson is not None else step_eta * fz + (1 - step_eta) * z
        if cfg.freeze_converged:
            z_next = torch.where(_per_token(frozen, z), z, z_next)
            frozen = frozen | (res < cfg.tol)
        token_res = res.float() if res.dtype != torch.float64 else res
        eta = next_eta
        z = z_next
        want_continue = (not (host[0] or host[1])) if consensus is None else bool(host[3])
        if not want_continue:
            stopped_by = ("converged" if host[0] and int(unconverged) == 0 else
                          "quantile" if host[0] else "eta_min" if host[1] else "max_iter")
            break
    return IterateResult(z=z, iterations=k, stopped_by=stopped_by, token_res=token_res,
                         token_converged=token_res < cfg.tol, eta=eta)
