"""The stop rule: which residual a unit's convergence test reads (``solver.compat.stop_residual``), the flags a
TP group agrees on each iteration (``StopFlags``), the quantile limit, and when the host reads
(``read_schedule``). The step that applies them is fpscale.solvers.step.

``solver.compat.stop_residual``:

  current   the residual of this iteration (fpscale's default): a sample counts as converged
            while its latest step is below ``tol``
  best      the lowest residual the sample has reached so far in this solve, this iteration
            included: once a sample has stepped below ``tol`` it stays converged. The FP-RNN
            authors' solver does this (dr-faustus/fp-rnn, models/model_utils.py,
            ``FixedPointOptimizer.step`` keeps ``state['residues']`` as the lowest residual
            and ``cont`` takes the quantile of those, with their own TODO asking whether the
            current one should be used)

"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fpscale.solvers.config import SolverConfig

STOP_RESIDUALS = ("current", "best")


def stop_residual(rule: str, sample_res: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """The residual per sample [B] that the convergence test compares with ``tol``: this
    iteration's ``sample_res``, or (``best``) its minimum with ``best``, the lowest residual of
    the earlier iterations (inf before the first). A non-finite residual stays non-finite."""
    if rule == "current":
        return sample_res
    if rule == "best":
        return torch.where(torch.isfinite(sample_res), torch.minimum(sample_res, best), sample_res)
    raise ValueError(f"unknown stop_residual {rule!r}: one of {', '.join(STOP_RESIDUALS)}")


@dataclass
class StopFlags:
    """What one rank saw in one iteration, as the flags its TP group agrees on.

    Each flag is set when *any* rank saw it, so the agreement is an element-wise MAX; ``pack``
    lays the flags out as one int64 tensor ``[nonfinite, unconverged (n), no_progress (n)]``
    for a single all-reduce and ``unpack`` reads the agreed tensor back. A unit is a sample
    ([B], ``decisions: sample``) or a token ([B, T], ``decisions: token``).
    """
    nonfinite: torch.Tensor     # [] bool: some residual is not finite
    unconverged: torch.Tensor   # [B] or [B, T] bool: the unit's residual >= tol
    no_progress: torch.Tensor   # [B] or [B, T] bool: the unit's residual is not a new best

    def pack(self) -> torch.Tensor:
        return torch.cat([self.nonfinite.view(1), self.unconverged.flatten(), self.no_progress.flatten()]).long()

    @classmethod
    def unpack(cls, packed: torch.Tensor, units: int | tuple) -> StopFlags:
        shape = (units,) if isinstance(units, int) else tuple(units)
        n = math.prod(shape)
        return cls(nonfinite=packed[0].bool(), unconverged=packed[1:n + 1].bool().view(shape),
                   no_progress=packed[n + 1:].bool().view(shape))


def quantile_limit(quantile: float, batch: int) -> int:
    """How many of ``batch`` samples may stay unconverged when the solve stops: floor(p * B)."""
    return math.floor(quantile * batch + 1e-9)


def eta_min_stop_within(cfg: SolverConfig, cap: int) -> bool:
    """Whether the eta_min stop could fire within ``cap`` iterations: every sample needs n decays
    (damping * decay^n < eta_min) and each decay ``patience`` iterations without progress. A
    conservative bound (a margin on eta_min, iteration 1 counted as if it could stagnate)."""
    if cfg.patience <= 0 or cfg.eta_min <= 0:
        return False
    eta, decays = cfg.damping, 0
    while eta >= cfg.eta_min * (1 + 1e-6):
        eta *= cfg.decay
        decays += 1
    return decays * cfg.patience <= cap


def read_schedule(cfg: SolverConfig, cap: int) -> int | None:
    """Every how many iterations the host reads the stop decision: ``cfg.check_every``, or None
    when no stop rule can fire within ``cap`` (tol 0: no sample ever counts as converged, so
    neither the quantile rule nor convergence can stop it; and no eta_min stop within the cap),
    in which case the cap runs with one read at its end. A function of the config and the cap
    alone: every rank of a tensor-parallel group reads at the same iterations."""
    if cfg.tol <= 0 and not eta_min_stop_within(cfg, cap):
        return None
    return cfg.check_every
