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
from fpscale.solvers.chunked import run_loop
from fpscale.solvers.config import IMPLICIT_MODES, SolverConfig
from fpscale.solvers.loop_state import IterateResult, state_dtype
from fpscale.solvers.precision import map_dtype, resolvable_tol, tf32_matmuls
from fpscale.solvers.stats import SolverStats
from fpscale.solvers.step import SolveContext


def solve(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, config: SolverConfig | None = None,
          context: SolveContext | None = None, *, training: bool | None = None, iterate_free: bool = False,
          **fields) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z = f(z)`` from ``z0`` ([batch, tokens, ...]).

    context    the call's fpscale.solvers.step.SolveContext (or its fields as keywords, below):
    training   selects the stop quantile and the cap: ``config.stop_quantile`` and ``max_iter``
               when True, p = 0 and ``eval_max_iter`` otherwise. None means "whether grad mode is on".
    consensus  reduces the stop flags over a process group (all TP ranks must iterate the same
               number of times with the same damping); see :mod:`fpscale.solvers.iterate`.
    state_reduce  completes per-token norms over a group when z is split over it (the
               channels of a tensor-parallel FP-Mamba layer); None when z is whole on every rank.
    max_iter   overrides the cap for this call (randomised caps, an evaluation depth).
    real       [batch, tokens] bool: the tokens that count in the stop test (left padding is
               not real; its residual counts as 0, so it never holds a sample's solve up).
    agree      sums the stop decision's counts over the data-parallel group (``solver.agree: dp``):
               the forward and the adjoint solve stop as one process over the DP group's samples.
    min_iter   no stop rule ends the solve before this many iterations (cached decoding: the new
               token's solve covers the iterations its past's per-iteration caches recorded)
    prefix     [B] long, per token: the iteration from which the tokens before z0's are all done
               (cached decoding: the previous chunk's ``stats.retired_at``; the prefix rule)
    group      entries of z per token (fpsa's heads, ``halting: head``): the unit of ``decisions: token``
    on_final   called once the iteration loop ended, before f is applied to z* (the output step, or
               the implicit backward's one application): cached decoding's f then reads the past's
               final entries (fpscale.layers.step_cache)
    iterate_free  f never reads its iterate (a plain Mamba baseline: ``FPMambaSpec.iterate_free``):
               f(z0) is then the exact fixed point, and the solve is that one application, under
               grad when grad mode is on (``apply_once``), whatever the cap and the backward mode.
    The output is the same function of the iterate in every grad mode (``config.eval_output: step``):
    implicit and unroll give z*, jfb f(z*), phantom f^k(z*) (k = ``phantom_steps``), under grad
    with the configured gradient, without grad as values.
    Returns (z, stats); z is in the solver's state dtype (float32 unless z0 is float64) and,
    with grad mode on, carries the gradient of ``config.backward``. The tolerances are raised to
    what the dtype f computes in can resolve (:mod:`fpscale.solvers.precision`).
    A non-finite z0 (an upstream NaN) is not an error: the solve stops at its first step with
    ``stopped_by == "nonfinite"``, so the NaN reaches the loss and the trainer skips the step
    on every rank (raising on one rank would leave its peers waiting in a collective).
    """
    cfg = config or SolverConfig()
    ctx = dataclasses.replace(context or SolveContext(), **fields)
    max_iter, on_final = ctx.max_iter, ctx.on_final
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
    implicit = grad and cfg.backward in IMPLICIT_MODES
    cfg = resolved(cfg, z0, implicit)
    if iterate_free:
        return apply_once(f, z0, cfg, cap, ctx.real)
    unroll = grad and cfg.backward == "unroll"
    with torch.enable_grad() if unroll else torch.no_grad():
        result = run_loop(f, z0 if unroll else z0.detach(), cfg, ctx, quantile=quantile, max_iter=cap,
                          min_iter=min(ctx.min_iter, cap))
    stats = stats_of(result, cap, cfg.tol)
    z = result.z
    if unroll:
        return z, stats
    if not grad:
        # One forward value in every mode (docs/solver.md, "One forward value in every mode"): what the
        # grad-mode forward outputs at this iterate, f(z*) for jfb and f^k(z*) for phantom, unless
        # ``eval_output: iterate``
        steps = cfg.output_steps if cfg.eval_output == "step" else 0
        if on_final is not None:
            on_final()
        with torch.no_grad():
            return (phantom(f, z, steps) if steps else z), stats
    if on_final is not None:
        on_final()
    return differentiable(f, z, cfg, stats, ctx), stats


def resolved(cfg: SolverConfig, z0: torch.Tensor, implicit: bool) -> SolverConfig:
    """``cfg`` with the tolerances the dtype f computes in can reach (fpscale.solvers.precision;
    ``backward_tol`` only where an adjoint runs: ``implicit``)."""
    dtype, tf32 = map_dtype(z0), tf32_matmuls(z0)
    tol = resolvable_tol(cfg.tol, dtype, "tol", tf32, cfg.norm)
    backward_tol = (resolvable_tol(cfg.backward_tol, dtype, "backward_tol", tf32, cfg.norm) if implicit
                    else cfg.backward_tol)
    return dataclasses.replace(cfg, forward=dataclasses.replace(cfg.forward, tol=tol),
                               adjoint=dataclasses.replace(cfg.adjoint, backward_tol=backward_tol))


def stats_of(result: IterateResult, cap: int, tol: float) -> SolverStats:
    """The statistics of a loop's result (its cap and applied tolerance)."""
    return SolverStats(iterations=result.iterations, max_iter=cap, stopped_by=result.stopped_by,
                       sample_residual=result.token_res.amax(1), token_converged=result.token_converged,
                       final_eta=result.eta, tol=tol, retired_at=result.retired_at,
                       entry_iterations=result.entry_iters,
                       row_iterations=(result.row_iterations if result.row_iterations is not None
                                       else result.iterations * result.z.shape[0]))


def differentiable(f: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, cfg: SolverConfig,
                   stats: SolverStats, ctx: SolveContext) -> torch.Tensor:
    """The grad-mode output at the fixed point z (detached) for ``cfg.backward``: z* with the implicit
    (or neumann1) adjoint attached, else f^k(z*) (jfb k = 1, phantom ``phantom_steps``). Deep
    supervision's final window calls this too (fpscale.layers.deep_supervision)."""
    if cfg.backward in IMPLICIT_MODES:
        return attach_implicit(f, z, cfg, stats, ctx.consensus, ctx.state_reduce, ctx.agree)
    return phantom(f, z, cfg.output_steps)


def apply_once(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, cap: int,
               real: torch.Tensor | None = None) -> tuple[torch.Tensor, SolverStats]:
    """The solve of a map that does not read its iterate: z* = f(z0), one application.

    Iterating would give f(z0) again at every step, and every backward mode would differentiate
    that same application (jfb/phantom: f of the detached z*; implicit: J_f = 0, so the adjoint
    is the incoming gradient; unroll: autograd through f(z0)). So f runs once, in the current
    grad mode, and its result, with its graph, is the layer's output: what the no-grad pass and
    then the differentiable step computed before, at the cost of one application instead of two
    (three with a cap above 1: the second no-grad pass only confirmed the residual was 0).

    Statistics: 1 iteration, ``converged``, residual 0 (f(z*) - z* = 0 exactly), the damping
    untouched. Nothing is read back to the host (no rule can fire, as with a fixed cap): a sample
    whose output is not finite gets a NaN residual and unconverged tokens, but ``stopped_by`` is
    not ``nonfinite``; the NaN reaches the loss, whose check makes the trainer skip the step."""
    z = f(z0.detach().to(state_dtype(z0.dtype)))
    if not isinstance(z, torch.Tensor) or z.shape != z0.shape:
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"solve: f(z) must return a tensor shaped like z {tuple(z0.shape)}, got {got}")
    z = z.to(state_dtype(z0.dtype))
    with torch.no_grad():
        finite = torch.isfinite(z.detach()).reshape(*z.shape[:2], -1).all(-1)       # [B, T]
        if real is not None:
            finite = finite | ~real
        residual = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device).masked_fill(~finite.all(1), float("nan"))
        eta = torch.full((z.shape[0],), cfg.damping, dtype=z.dtype, device=z.device)
    stats = SolverStats(iterations=1, max_iter=cap, stopped_by="converged", sample_residual=residual,
                        token_converged=finite, final_eta=eta, tol=cfg.tol)
    return z, stats
