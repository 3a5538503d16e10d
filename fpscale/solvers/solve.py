"""`solve(f, z0, config)`: find z* = f(z*) and make it differentiable the configured way.

    >>> import torch
    >>> from fpscale.solvers import solve, SolverConfig
    >>> W = 0.3 * torch.eye(4); x = torch.randn(2, 3, 4)
    >>> z, stats = solve(lambda z: torch.tanh(z @ W + x), torch.zeros_like(x), SolverConfig(tol=1e-6))
    >>> stats.stopped_by
    'converged'
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fpscale.solvers.backward import attach_implicit, phantom
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.iterate import Consensus, StateReduce, iterate
from fpscale.solvers.precision import map_dtype, resolvable_tol
from fpscale.solvers.stats import SolverStats


def solve(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, config: SolverConfig | None = None,
          *, training: bool | None = None, consensus: Consensus | None = None,
          state_reduce: StateReduce | None = None, max_iter: int | None = None,
          real: torch.Tensor | None = None) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z = f(z)`` from ``z0`` ([batch, tokens, ...]).

    training   selects the stop quantile and the cap: ``config.stop_quantile`` and ``max_iter``
               when True, p = 0 and ``eval_max_iter`` otherwise. None means "whether grad mode is on".
    consensus  reduces the stop flags over a process group (all TP ranks must iterate the same
               number of times with the same damping); see :mod:`fpscale.solvers.iterate`.
    state_reduce  completes per-token norms over a group when z is split over it (the
               channels of a tensor-parallel FP-Mamba layer); None when z is whole on every rank.
    max_iter   overrides the cap for this call (randomised caps, an evaluation depth).
    real       [batch, tokens] bool: the tokens that count in the stop test (left padding is
               not real; its residual counts as 0, so it never holds a sample's solve up).
    Returns (z, stats); z is in the solver's state dtype (float32 unless z0 is float64) and,
    with grad mode on, carries the gradient of ``config.backward``. The tolerances are raised to
    what the dtype f computes in can resolve (:mod:`fpscale.solvers.precision`).
    A non-finite z0 (an upstream NaN) is not an error: the solve stops at its first step with
    ``stopped_by == "nonfinite"``, so the NaN reaches the loss and the trainer skips the step
    on every rank (raising on one rank would leave its peers waiting in a collective).
    """
    cfg = config or SolverConfig()
    if not isinstance(z0, torch.Tensor) or z0.dim() < 2:
        raise ValueError(f"solve: z0 must be a tensor shaped [batch, tokens, ...], got "
                         f"{tuple(z0.shape) if isinstance(z0, torch.Tensor) else type(z0).__name__}")
    if max_iter is not None and max_iter < 1:
        raise ValueError(f"solve: max_iter must be >= 1, got {max_iter}")
    if training is None:
        training = torch.is_grad_enabled()
    quantile = cfg.stop_quantile if training else 0.0
    grad = torch.is_grad_enabled()
    cap = max_iter or (cfg.max_iter if training else cfg.eval_iterations)
    # the tolerances the dtype f computes in can reach (backward_tol only where an adjoint runs)
    dtype, implicit = map_dtype(z0), grad and cfg.backward == "implicit"
    cfg = dataclasses.replace(cfg, tol=resolvable_tol(cfg.tol, dtype, "tol"), backward_tol=(
        resolvable_tol(cfg.backward_tol, dtype, "backward_tol") if implicit else cfg.backward_tol))
    unroll = grad and cfg.backward == "unroll"
    with torch.enable_grad() if unroll else torch.no_grad():
        result = iterate(f, z0 if unroll else z0.detach(), cfg, quantile=quantile, consensus=consensus,
                         state_reduce=state_reduce, max_iter=cap, real=real)
    stats = SolverStats(iterations=result.iterations, max_iter=cap, stopped_by=result.stopped_by,
                        sample_residual=result.token_res.amax(1), token_converged=result.token_converged,
                        final_eta=result.eta, tol=cfg.tol)
    z = result.z
    if not grad or unroll:
        return z, stats
    if implicit:
        return attach_implicit(f, z, cfg, stats, consensus, state_reduce), stats
    return phantom(f, z, 1 if cfg.backward == "jfb" else cfg.phantom_steps), stats
