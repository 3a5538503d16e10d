"""``solver.chunk: K``: the fixed-point loop as chunks of K iterations, every decision a device mask.

The PyTorch loop (fpscale.solvers.iterate) decides on the host when to stop; here a chunk runs K
iterations of the same loop with no host read inside: the stop, the freezing, the damping and
patience (Algorithm 1, per sample) and the quantile test are tensors, and the solve's state
carries a device flag ``running``. An iteration the eager loop would not have run (after the stop,
past the cap) applies f and then leaves every sample and token as it was (``torch.where``), so the
iterate, the damping, the residuals, the frozen tokens, the iteration count and the stop reason
are the eager loop's, and so are the gradients (the unroll backward differentiates through the
selects: the branch not taken gets a zero gradient). The count is not rounded up to the chunk:
what is wasted is at most K - 1 applications of f after the stop. After each chunk the host reads
one small tensor [running, iterations, stop reason] (one synchronisation per chunk).

A chunk is one function of tensors, compiled with ``torch.compile(fullgraph=True, dynamic=False)``
where it can be traced as one graph: a solve without autograd through the loop (every forward
solve of the implicit, phantom and jfb backward modes, evaluation) and without collectives
(no ``consensus``, ``state_reduce`` or ``agree``). The iteration number and the cap enter as
device scalars, so neither a different iteration count nor a different number of chunks
recompiles (tests/solvers/test_chunked.py counts it). Elsewhere the same chunk runs eager, still
with one host read per chunk:
  unroll       autograd through K unrolled iterations (compiling it would also save every
               iteration's activations, as the eager unroll does)
  TP / DP      the stop flags are agreed every iteration, as in the eager loop (a collective, not
               a host read), so every rank takes the same decisions as the eager loop's
  adjoint      the adjoint's step is ``torch.autograd.grad`` of the recorded f, which dynamo does
               not trace in one graph: the first such step found untraceable is remembered (by its
               code) and its chunks run eager from then on, said once
Not supported (an error naming the combination): Anderson mixing (its history is a host-side list).
``check_every`` and ``bookkeeping`` do not apply: a chunked solve reads once per chunk and keeps
its bookkeeping in the traced graph (the compiler fuses it with f).
"""
from __future__ import annotations

import types
import warnings
from typing import Callable

import torch

from fpscale.solvers.config import SolverConfig
from fpscale.solvers.iterate import StopFlags, _Counts, _per_sample, _per_token, iterate, quantile_limit, token_residual
from fpscale.solvers.loop_state import Carry, IterateResult, check_step_output, state_dtype
from fpscale.solvers.stop_rule import stop_residual

STOP_REASONS = ("max_iter", "converged", "quantile", "eta_min", "nonfinite")
_UNTRACEABLE: set = set()          # code objects of steps that did not trace as one graph


def _chunk(step, z, eta, best, patience_left, frozen, token_res, running, iters, reason, k0, cap,
           real, cfg: SolverConfig, limit: torch.Tensor, K: int, consensus, state_reduce, agree):
    """K iterations of the eager loop from iteration ``k0 + 1`` (device scalars ``k0``, ``cap``);
    returns the state after them."""
    tol = cfg.tol
    for i in range(K):
        k = k0 + (i + 1)
        active = running & (k <= cap)
        fz = step(z)
        check_step_output(fz, z)
        fz = fz.to(z.dtype)
        with torch.no_grad():
            res = token_residual(fz.detach(), z.detach(), cfg.norm, cfg.eps, state_reduce)
            res = torch.where(frozen, token_res, res)
            if real is not None:
                res = res.masked_fill(~real, 0.0)
            sample_res = res.amax(1)
            finite = torch.isfinite(sample_res)
            flags = StopFlags(nonfinite=~finite.all(),
                              unconverged=~(stop_residual(cfg.stop_residual, sample_res, best) < tol),
                              no_progress=~(sample_res < best))
            if consensus is not None:
                flags = StopFlags.unpack(consensus(flags.pack()), z.shape[0])
            new_best = torch.where(flags.no_progress, best, sample_res)
            if cfg.patience > 0:
                left = torch.where(flags.no_progress, patience_left - 1, cfg.patience)
                decay_now = left <= 0
                next_eta = torch.where(decay_now, eta * cfg.decay, eta)
                left = torch.where(decay_now, cfg.patience, left)
            else:
                next_eta, left = eta, patience_left
            counts = _Counts(flags, next_eta, cfg.eta_min, agree)
            n_unconverged, movable = counts.sums()
            nonfinite = counts.nonfinite
            update = active & ~nonfinite
            best = torch.where(active, new_best, best)
            patience_left = torch.where(active, left, patience_left)
        step_eta = _per_sample(eta, z)
        z_next = step_eta * fz + (1 - step_eta) * z
        if cfg.freeze_converged:
            z_next = torch.where(_per_token(frozen, z), z, z_next)
        z = torch.where(update, z_next, z)
        with torch.no_grad():
            if cfg.freeze_converged:
                frozen = torch.where(update, frozen | (res < tol), frozen)
            token_res = torch.where(update, res.to(token_res.dtype), token_res)
            eta = torch.where(update, next_eta, eta)
            met, stalled = n_unconverged <= limit, movable == 0      # limit: a device scalar
            stop = active & (nonfinite | met | stalled)
            code = torch.where(nonfinite, 4, torch.where(n_unconverged == 0, 1, torch.where(met, 2, 3)))
            reason = torch.where(stop, code, reason)
            iters = torch.where(active, k, iters)
            running = running & ~stop
    return z, eta, best, patience_left, frozen, token_res, running, iters, reason


_COMPILED: dict = {}               # step code -> its compiled chunk


def _compiled_chunk(code) -> Callable:
    """The chunk compiled for the steps of one code object (a layer type's closure): a copy of
    ``_chunk`` with its own code object, so each layer type has its own cache of graphs (dynamo's
    recompile limit counts per code object: the layer types of one model, in training and
    evaluation, would otherwise share one limit of 8)."""
    if code not in _COMPILED:
        own = types.FunctionType(_chunk.__code__.replace(), _chunk.__globals__, "_chunk", _chunk.__defaults__)
        _COMPILED[code] = torch.compile(own, fullgraph=True, dynamic=False)
    return _COMPILED[code]


COMPILE = True      # False: every chunk runs eager (the same function; tests of the semantics skip Inductor)


def check_chunked(cfg: SolverConfig, carry: Carry | None = None) -> None:
    if cfg.anderson:
        raise ValueError(f"solver.chunk = {cfg.chunk} with solver.anderson = {cfg.anderson}: Anderson mixing keeps "
                         "its history on the host and is not chunked; set solver.chunk: 0 or solver.anderson: 0")


def run_loop(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, *,
             quantile: float, consensus=None, state_reduce=None, max_iter: int | None = None, real=None,
             agree=None, carry: Carry | None = None) -> IterateResult:
    """The solver's loop as ``cfg.chunk`` says: ``iterate`` (0, the default) or ``iterate_chunked``.
    The callers of the loop (the forward solve, the adjoint, deep supervision's windows) call this."""
    if not cfg.chunk:
        return iterate(step, z0, cfg, quantile=quantile, consensus=consensus, state_reduce=state_reduce,
                       max_iter=max_iter, real=real, agree=agree, carry=carry)
    limit = quantile_limit(quantile, z0.shape[0] * (agree.size if agree is not None else 1))
    return iterate_chunked(step, z0, cfg, limit=limit, consensus=consensus, state_reduce=state_reduce,
                           max_iter=cfg.max_iter if max_iter is None else max_iter, real=real, agree=agree,
                           carry=carry)


def iterate_chunked(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, *,
                    limit: int, consensus=None, state_reduce=None, max_iter: int, real=None, agree=None,
                    carry: Carry | None = None) -> IterateResult:
    """``fpscale.solvers.iterate.iterate`` in chunks of ``cfg.chunk`` iterations (module docstring)."""
    check_chunked(cfg, carry)
    K, dtype, dev = cfg.chunk, state_dtype(z0.dtype), z0.device
    B = z0.shape[0]
    z = z0.to(dtype)
    if carry is not None:
        eta, best, patience_left, frozen, token_res = (carry.eta, carry.best, carry.patience_left, carry.frozen,
                                                       carry.token_res)
    else:
        eta = torch.full((B,), cfg.damping, dtype=dtype, device=dev)
        best = torch.full((B,), float("inf"), dtype=dtype, device=dev)
        patience_left = torch.full((B,), cfg.patience, dtype=torch.long, device=dev)
        frozen = torch.zeros(z0.shape[:2], dtype=torch.bool, device=dev)
        token_res = torch.full(z0.shape[:2], float("inf"), dtype=dtype, device=dev)
    running = torch.ones((), dtype=torch.bool, device=dev)
    iters = torch.zeros((), dtype=torch.long, device=dev)
    reason = torch.zeros((), dtype=torch.long, device=dev)
    cap = torch.full((), max_iter, dtype=torch.long, device=dev)
    limit_t = torch.full((), limit, dtype=torch.long, device=dev)     # training and evaluation share a graph
    code = getattr(step, "__code__", None)
    traced = (COMPILE and not torch.is_grad_enabled() and consensus is None and state_reduce is None and agree is None
              and code not in _UNTRACEABLE)
    state = (z, eta, best, patience_left, frozen, token_res, running, iters, reason)
    done = False
    for k0 in range(0, max_iter, K):
        args = (step, *state, torch.full((), k0, dtype=torch.long, device=dev), cap, real, cfg, limit_t, K,
                consensus, state_reduce, agree)
        if traced:
            try:
                state = _compiled_chunk(code)(*args)
            except torch._dynamo.exc.TorchDynamoException as exc:
                traced = False
                _UNTRACEABLE.add(code)
                warnings.warn(f"solver.chunk: a solve's step ({getattr(step, '__qualname__', step)}) does not trace "
                              f"as one graph ({type(exc).__name__}); its chunks run eager (one host read per "
                              f"chunk still)", stacklevel=3)
                state = _chunk(*args)
        else:
            state = _chunk(*args)
        running, iters, reason = state[6:]
        with torch.no_grad():
            alive, n, why = torch.stack([running.long(), iters, reason]).tolist()     # the chunk's one read
        if not alive:
            done = True
            break
    z, eta, best, patience_left, frozen, token_res = state[:6]
    stopped_by = STOP_REASONS[why] if done else "max_iter"
    return IterateResult(z=z, iterations=n, stopped_by=stopped_by, token_res=token_res,
                         token_converged=token_res < cfg.tol, eta=eta,
                         carry=Carry(eta, best, patience_left, frozen, token_res))
