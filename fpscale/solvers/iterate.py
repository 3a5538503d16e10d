"""The fixed-point iteration shared by the forward solve and the adjoint solve.

One loop, at most one host synchronisation per iteration (the stop decision):
  state                 z is kept in float32 (float64 stays float64) whatever dtype f computes in
  residual per token    r_t = ||f(z)_t - z_t|| / (||f(z)_t|| + eps)     (inf or l2 norm)
  residual per sample   r_b = max_t r_t;   sample b is converged when r_b < tol (``stop_residual``
                        best: when its lowest r_b so far is; fpscale.solvers.stop_rule)
  quantile stop         stop once at most floor(p * B) samples are unconverged, i.e. at least
                        (1 - p) of the B samples this solve sees have converged (p = 0: all)
  decisions             where Algorithm 1's damping, patience and freezing live (``solver.forward.decisions``):
    token (default)     per token, the causal rule: token t's eta_t, best r_t and patience follow
                        its own residual r_t, which a causal f computes from tokens <= t; token t
                        retires (is frozen) once every token s <= t is done, converged (r_s < tol)
                        or stalled (eta_s below eta_min): the prefix rule, so its value is what it
                        was then whenever the solve stops, and nothing it reads moves afterwards.
                        Anderson mixes per token. docs/solver.md, "Causality"
    sample              per sample (FPRM Algorithm 1 applied to each sample, as the FP-RNN authors'
                        solver does): every token of a sample shares eta_b, which the sample's
                        largest residual drives; freezing only with ``freeze_converged``
  damped step           z <- eta f(z) + (1 - eta) z   (or Anderson mixing, weight eta)
  patience              eta <- decay * eta after `patience` steps without a new best residual
  safeguards            cap; every unconverged unit's eta below eta_min; non-finite residual
                        (the last finite z is kept)
  freezing              a converged token is frozen: its value never changes again

Under tensor parallelism a ``consensus`` callable takes the MAX of this rank's :class:`StopFlags`
over the group once per iteration (packed into one tensor, so one all-reduce). Every decision
(stopping, each sample's eta) is a function of the agreed flags, so all ranks take the same
number of iterations with the same damping, even if their residuals differed in the last bit.
The decision reaches the host as one small tensor (the iteration's one sync).

The iteration is written once (fpscale.solvers.step.advance) and run in chunks by
fpscale.solvers.chunked.run_loop, whose schedules (eager, ``check_every``, ``chunk``, the fused bookkeeping)
give the same iterates, counts and stop reasons (docs/solver.md, "Execution modes").
"""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.solvers.chunked import run_loop
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.loop_state import Carry, IterateResult, state_dtype
from fpscale.solvers.step import Agree, Consensus, SolveContext, StateReduce, fresh_state, token_residual
from fpscale.solvers.stop_rule import StopFlags, quantile_limit, read_schedule

__all__ = ["iterate", "Agree", "Consensus", "StateReduce", "SolveContext", "Carry", "IterateResult", "StopFlags",
           "fresh_state", "quantile_limit", "read_schedule", "state_dtype", "token_residual"]


def iterate(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig,
            context: SolveContext | None = None, *, quantile: float, carry: Carry | None = None,
            **fields) -> IterateResult:
    """The loop with the stop read on the host as ``cfg.check_every`` says (``solver.execution.chunk`` ignored):
    ``run_loop(..., chunk=0)``. ``context`` or its fields as keywords (consensus, state_reduce, agree,
    real, prefix, group, min_iter, max_iter): fpscale.solvers.step.SolveContext. ``carry``: a previous
    call's ``IterateResult.carry`` to go on from (deep supervision's windows)."""
    return run_loop(step, z0, cfg, context, quantile=quantile, carry=carry, chunk=0, **fields)
