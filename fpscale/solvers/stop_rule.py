"""Which residual a sample's convergence test reads (``solver.stop_residual``).

  current   the residual of this iteration (fpscale's default): a sample counts as converged
            while its latest step is below ``tol``
  best      the lowest residual the sample has reached so far in this solve, this iteration
            included: once a sample has stepped below ``tol`` it stays converged. The FP-RNN
            authors' solver does this (dr-faustus/fp-rnn, models/model_utils.py,
            ``FixedPointOptimizer.step`` keeps ``state['residues']`` as the lowest residual
            and ``cont`` takes the quantile of those, with their own TODO asking whether the
            current one should be used)

Kept apart from fpscale.solvers.iterate so the rule is one function the loop calls.
"""
from __future__ import annotations

import torch

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
