"""``solver.chunk: K``: the fixed-point loop as chunks of K iterations, every decision a device mask.

The PyTorch loop (fpscale.solvers.iterate) decides on the host when to stop; here a chunk runs K
iterations of the same loop (its ``_observe``, damped step and retirement: ``decisions`` token or
sample) with no host read inside: the stop, ``min_iter``, the freezing and the prefix rule's
retirement, the damping and patience (Algorithm 1) and the quantile test are tensors, and the
solve's state carries a device flag ``running``. An iteration the eager loop would not have run (after the stop,
past the cap) applies f and then leaves every sample and token as it was (``torch.where``), so the
iterate, the damping, the residuals, the frozen tokens, ``retired_at``, the iteration count and the
stop reason are the eager loop's, and so are the gradients (the unroll backward differentiates through the
selects: the branch not taken gets a zero gradient). The count is not rounded up to the chunk:
what is wasted is at most K - 1 applications of f after the stop (under ``agree: dp`` up to 2K - 1, once
per solve: the replay). After each chunk the host reads one small tensor [running, iterations, stop
reason, TP flags differ, DP k*] (one synchronisation per chunk).

Agreement with the other ranks is once per chunk (fpscale.solvers.chunk_agree): under ``agree: dp`` the
chunk runs with the stop off except the cap, records its local counts [K, 3], and one SUM all-reduce
after it gives the first stopping iteration k*, to which the chunk is replayed from its start where it
ran past it (the same graph: the eager loop's state at k*); under TP the ranks' stop flags, the same
on every rank, are checked once per chunk (one MAX all-reduce of the packed flags; an error naming
``solver.chunk`` if they differ) instead of a MAX every iteration; fpsa's heads (``halting: head``), whose
ranks hold different entries of a token, agree every iteration inside the chunk (``EveryIteration``).
One host read per chunk either way; the replay adds none.

A chunk is one function of tensors, compiled with ``torch.compile(fullgraph=True, dynamic=False)``
where it can be traced as one graph: a solve without autograd through the loop (every forward
solve of the implicit, phantom and jfb backward modes, evaluation), under TP and DP too: the chunk
holds no collective of the solver's (but fpsa heads' consensus), and f's own (TP's all-reduces, the
norms' ``state_reduce``) trace as functional collectives (gloo included; tests/parallel/run_tp_model.py
compiles one). The iteration number, the cap, ``min_iter``, the quantile limit, the DP replay's
cap and non-finite iteration enter as device scalars, so neither a different iteration count nor a
different number of chunks (nor training vs evaluation, nor a replay, nor a new closure per forward)
recompiles (tests/solvers/test_chunked.py, test_chunk_agree.py count it). Elsewhere the same chunk
runs eager, still with one host read per chunk:
  unroll       autograd through K unrolled iterations (compiling it would also save every
               iteration's activations, as the eager unroll does)
  adjoint      the adjoint's step is ``torch.autograd.grad`` of the recorded f, which dynamo does
               not trace in one graph: the first such step found untraceable is remembered (by its
               code) and its chunks run eager from then on, said once
``solver.cuda_graph`` (CUDA): the compiled chunk with mode reduce-overhead, captured and replayed by
Inductor's CUDA graph trees (``_replay``; ``check_cuda_graph`` refuses it off CUDA and under TP).
Not supported (an error naming the combination): Anderson mixing (its history is a host-side list).
``check_every`` and ``bookkeeping`` do not apply: a chunked solve reads once per chunk and keeps
its bookkeeping in the traced graph (the compiler fuses it with f).
"""
from __future__ import annotations

import types
import warnings
from typing import Callable

import torch

from fpscale.solvers.chunk_agree import differs, first_stop, pack_flags, words_for
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.iterate import _damped_step, _observe, _per_token, fresh_state, iterate, quantile_limit
from fpscale.solvers.loop_state import NEVER, Carry, IterateResult, state_dtype

STOP_REASONS = ("max_iter", "converged", "quantile", "eta_min", "nonfinite")
_UNTRACEABLE: set = set()          # code objects of steps that did not trace as one graph
UNTRACEABLE_WHY: dict[str, str] = {}   # their qualified names -> the compiler's message (the benches record it)


def _chunk(step, z, eta, best, patience_left, frozen, token_res, retired_at, running, iters, reason, k0, cap,
           min_iter, limit, bad_at, defer, real, prefix, cfg: SolverConfig, K: int, state_reduce, group: int = 1,
           verify: bool = False, consensus=None):
    """K iterations of the eager loop from iteration ``k0 + 1``: the loop's own ``_observe``, damped
    step and retirement (``decisions: token`` or ``sample``), every host decision a mask (``k0``,
    ``cap``, ``min_iter``, the quantile ``limit`` and ``bad_at`` are device scalars).
    ``defer`` (``agree: dp``; a Python bool, so a chunk without DP carries none of its ops): no stop but
    the cap, and no update at iteration ``bad_at`` (a replay's non-finite k*); the decision is taken
    after the chunk over the DP group (fpscale.solvers.chunk_agree). Returns the state after them,
    (``defer``) the local counts [K, 3] per iteration and (``verify``, TP) the flags packed as words.
    ``consensus`` (TP, fpsa's heads: the flags differ by rank) agrees the flags every iteration, as the
    eager loop does."""
    by_token, tol = cfg.decisions == "token", cfg.tol
    if hasattr(step, "per_chunk"):          # a step that prepares once per chunk (backward.VjpStep)
        step = step.per_chunk()
    rows = []
    W = words_for(K) if verify else 0
    words = [torch.zeros(best.shape, dtype=torch.long, device=z.device) for _ in range(W)]
    nonfinite_words = [torch.zeros((), dtype=torch.long, device=z.device) for _ in range(W)]
    for i in range(K):
        k = k0 + (i + 1)
        active = running & (k <= cap)
        fz, res, counts, new_best, new_left, next_eta = _observe(
            step, z, i + 1, cfg, frozen, token_res, real, best, patience_left, eta, consensus, state_reduce, None,
            group)
        with torch.no_grad():
            n_unconverged, movable = counts.sums()
            nonfinite = counts.nonfinite
            # the eager loop breaks before the update on a non-finite residual (under DP: on any rank's)
            update = active & ((k != bad_at) if defer else ~nonfinite)
            best = torch.where(active, new_best, best)
            patience_left = torch.where(active, new_left, patience_left)
            if defer:
                rows.append(torch.stack([n_unconverged, movable, nonfinite.long()]) * active)
            if verify:
                pack_flags(words, nonfinite_words, counts.flags, i, active)
        z_next = _damped_step(z, fz, eta, None, by_token, group)
        if by_token or cfg.freeze_converged:
            z_next = torch.where(_per_token(frozen, z), z, z_next)
        z = torch.where(update, z_next, z)
        with torch.no_grad():
            if by_token or cfg.freeze_converged:
                newly, prefix_done = counts.retire(res, tol, k, prefix, group)
                frozen = torch.where(update, frozen | newly, frozen)
                retired_at = torch.where(update & prefix_done & (retired_at == NEVER), k, retired_at)
            token_res = torch.where(update, res.to(token_res.dtype), token_res)
            eta = torch.where(update, next_eta, eta)
            iters = torch.where(active, k, iters)
            if not defer:
                met, stalled = n_unconverged <= limit, movable == 0
                stop = active & (nonfinite | ((k >= min_iter) & (met | stalled)))
                code = torch.where(nonfinite, 4, torch.where(n_unconverged == 0, 1, torch.where(met, 2, 3)))
                reason = torch.where(stop, code, reason)
                running = running & ~stop
    packed = torch.cat([torch.stack(nonfinite_words), torch.stack(words).flatten()]) if verify else None
    counted = torch.stack(rows) if defer else None
    return (z, eta, best, patience_left, frozen, token_res, retired_at, running, iters, reason), counted, packed


_COMPILED: dict = {}               # step code -> its compiled chunk


def _compiled_chunk(code, graphed: bool = False) -> Callable:
    """The chunk compiled for the steps of one code object (a layer type's closure): a copy of
    ``_chunk`` with its own code object, so each layer type has its own cache of graphs (dynamo's
    recompile limit counts per code object: the layer types of one model, in training and
    evaluation, would otherwise share one limit of 8). ``graphed`` (``solver.cuda_graph``): compiled
    with mode reduce-overhead, Inductor's CUDA graph trees (the graph captured per geometry and dtype,
    the inputs that are not parameters copied into its static buffers at each replay)."""
    if (code, BACKEND, graphed) not in _COMPILED:
        own = types.FunctionType(_chunk.__code__.replace(), _chunk.__globals__, "_chunk", _chunk.__defaults__)
        if graphed:          # Inductor's CUDA graph trees
            _COMPILED[code, BACKEND, graphed] = torch.compile(own, fullgraph=True, dynamic=False,
                                                              mode="reduce-overhead")
        else:
            _COMPILED[code, BACKEND, graphed] = torch.compile(own, fullgraph=True, dynamic=False, backend=BACKEND)
    return _COMPILED[code, BACKEND, graphed]


def _replay(compiled: Callable, args: tuple):
    """One replay of a captured chunk: a new step begins for the graph trees (the previous replay's
    outputs may be overwritten), so what the solve keeps is cloned out of the graph's pool; a step
    that keeps tensors of its own across calls (fpsa's entry counter) takes them out with its
    ``after_replay``."""
    torch.compiler.cudagraph_mark_step_begin()
    state, counts, words = compiled(*args)
    own = getattr(args[0], "after_replay", None)
    if own is not None:
        own()
    return tuple(t.clone() for t in state), *(None if t is None else t.clone() for t in (counts, words))


_TP_CAPTURE = ("the chunk would capture f's collectives (not yet checked); set solver.cuda_graph: false or "
               "parallel.tp: 1")


def check_cuda_graph(cfg: SolverConfig, device, tp: int = 1, where: str = "") -> None:
    """``solver.cuda_graph`` at launch: a CUDA device and no tensor parallelism (errors name the key)."""
    if not cfg.cuda_graph:
        return
    if torch.device(device).type != "cuda":
        raise ValueError(f"solver.cuda_graph = true{where} captures CUDA graphs: it needs a CUDA device, this run is "
                         f"on {device}; set solver.cuda_graph: false (solver.chunk still compiles the chunk)")
    if tp > 1:
        raise ValueError(f"solver.cuda_graph = true{where} with parallel.tp = {tp}: {_TP_CAPTURE}")


def check_cuda_graphs(model: torch.nn.Module, device, tp: int = 1) -> None:
    """``check_cuda_graph`` for every looped layer of ``model`` (the trainer, at launch)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "solver", None), SolverConfig):
            check_cuda_graph(module.solver, device, tp, where=f" ({name})")


COMPILE = True      # False: every chunk runs eager (the same function; tests of the semantics skip Inductor)
BACKEND = "inductor"   # tests counting graph breaks and recompilations (dynamo's) use aot_eager: no C++ build


CHUNKED_NORMS = ("inf", "l2")      # the per-token norms of iterate.token_residual


def check_chunked(cfg: SolverConfig) -> None:
    """The combinations a chunk does not implement, refused by name (not run differently)."""
    norm = getattr(cfg, "norm", "inf")
    if norm not in CHUNKED_NORMS:
        raise ValueError(f"solver.chunk = {cfg.chunk} with solver.norm = {norm}: the chunked loop implements the "
                         f"per-token norms {', '.join(CHUNKED_NORMS)}; set solver.chunk: 0 for {norm}")
    if cfg.anderson:
        raise ValueError(f"solver.chunk = {cfg.chunk} with solver.anderson = {cfg.anderson}: Anderson mixing keeps "
                         "its history on the host and is not chunked; set solver.chunk: 0 or solver.anderson: 0")


def run_loop(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, *,
             quantile: float, consensus=None, state_reduce=None, max_iter: int | None = None, real=None,
             agree=None, carry: Carry | None = None, min_iter: int = 0, prefix=None, group: int = 1) -> IterateResult:
    """The solver's loop as ``cfg.chunk`` says: ``iterate`` (0, the default) or ``iterate_chunked``.
    The callers of the loop (the forward solve, the adjoint, deep supervision's windows) call this."""
    if not cfg.chunk:
        return iterate(step, z0, cfg, quantile=quantile, consensus=consensus, state_reduce=state_reduce,
                       max_iter=max_iter, real=real, agree=agree, carry=carry, min_iter=min_iter, prefix=prefix,
                       group=group)
    limit = quantile_limit(quantile, z0.shape[0] * (agree.size if agree is not None else 1))
    return iterate_chunked(step, z0, cfg, limit=limit, consensus=consensus, state_reduce=state_reduce,
                           max_iter=cfg.max_iter if max_iter is None else max_iter, real=real, agree=agree,
                           carry=carry, min_iter=min_iter, prefix=prefix, group=group)


def iterate_chunked(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, *,
                    limit: int, consensus=None, state_reduce=None, max_iter: int, real=None, agree=None,
                    carry: Carry | None = None, min_iter: int = 0, prefix=None, group: int = 1) -> IterateResult:
    """``fpscale.solvers.iterate.iterate`` in chunks of ``cfg.chunk`` iterations (module docstring)."""
    check_chunked(cfg)
    min_iter = max(min_iter, getattr(cfg, "min_iter", 0))      # solver.min_iter where the config has it
    K, dev = cfg.chunk, z0.device
    z = z0.to(state_dtype(z0.dtype))
    start = carry if carry is not None else fresh_state(z0, cfg, group)

    def scalar(value: int, dtype=torch.long) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=dev)

    retired_at = torch.full((z0.shape[0],), NEVER, dtype=torch.long, device=dev)
    state = (z, start.eta, start.best, start.patience_left, start.frozen, start.token_res, retired_at,
             scalar(1, torch.bool), scalar(0), scalar(0))
    # the cap, min_iter and the quantile limit as device scalars: training, evaluation and decoding share a graph
    cap, low, lim, never = scalar(max_iter), scalar(min_iter), scalar(limit), scalar(NEVER)
    # TP: the flags are checked once per chunk, except where the layer says its ranks hold different entries
    # of a unit (fpsa's heads: a token's flags are the MAX over its heads on every rank, each iteration)
    per_iteration = consensus if getattr(consensus, "every_iteration", False) else None
    defer, verify = agree is not None, consensus is not None and per_iteration is None
    code = getattr(step, "__code__", None) or getattr(getattr(step, "per_chunk", None), "__code__", None)
    traced = COMPILE and not torch.is_grad_enabled() and code not in _UNTRACEABLE
    graphed = traced and cfg.cuda_graph
    if cfg.cuda_graph:                  # the launch's check (check_cuda_graph), at the solve
        if not z0.is_cuda:
            check_cuda_graph(cfg, z0.device)
        if consensus is not None or state_reduce is not None:
            raise ValueError(f"solver.cuda_graph = true under tensor parallelism: {_TP_CAPTURE}")

    def run(state, k0: int, cap, bad_at):
        nonlocal traced, graphed
        args = (step, *state, scalar(k0), cap, low, lim, bad_at, defer, real, prefix, cfg, K,
                state_reduce, group, verify, per_iteration)
        if traced:
            try:
                return _replay(_compiled_chunk(code, True), args) if graphed else _compiled_chunk(code)(*args)
            except torch._dynamo.exc.TorchDynamoException as exc:
                traced = graphed = False
                _UNTRACEABLE.add(code)
                name = getattr(step, "__qualname__", str(step))
                UNTRACEABLE_WHY[name] = f"{type(exc).__name__}: {exc}"
                first = next((line for line in str(exc).splitlines() if line.strip()), "")[:300]
                warnings.warn(f"solver.chunk: a solve's step ({name}) does not trace as one graph "
                              f"({type(exc).__name__}: {first}); its chunks run eager (one host read per chunk "
                              "still)", stacklevel=4)
        return _chunk(*args)

    done, n, why = False, max_iter, 0
    for k0 in range(0, max_iter, K):
        begin = state
        state, counts, words = run(state, k0, cap, never)
        running, iters, reason = state[7:]
        with torch.no_grad():
            mismatch = differs(consensus, words) if verify else running               # TP: one all-reduce
            if defer:                                                               # DP: one all-reduce
                stopped, kstar, reason = first_stop(agree(counts), k0, cap, low, lim)
                running = ~stopped
            else:
                kstar = iters
            alive, n, why, bad, k_star = torch.stack([running.long(), iters, reason, mismatch.long(), kstar]).tolist()
        if verify and bad:                                                          # (the chunk's one read)
            raise RuntimeError(f"solver.chunk = {K} under tensor parallelism: the ranks of a TP group saw different "
                               f"stop flags in iterations {k0 + 1}..{k0 + K} (a collective or a step that is not "
                               "bitwise the same on every rank); the chunk agrees once per chunk and needs them "
                               "equal: set solver.chunk: 0 (the eager loop agrees every iteration)")
        if defer and not alive:      # the DP group stops at k*: the state there, replayed where the chunk ran past it
            if k_star < n or why == 4:
                state, _, _ = run(begin, k0, scalar(k_star), scalar(k_star) if why == 4 else never)
            n, done = k_star, True
            break
        if not alive:
            done = True
            break
    z, eta, best, patience_left, frozen, token_res, retired_at = state[:7]
    return IterateResult(z=z, iterations=n, stopped_by=STOP_REASONS[why] if done else "max_iter",
                         token_res=token_res, token_converged=token_res < cfg.tol, eta=eta,
                         carry=Carry(eta, best, patience_left, frozen, token_res), retired_at=retired_at)
