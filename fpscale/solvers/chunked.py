"""The solver's loop: chunks of iterations of the one step (fpscale.solvers.step), read once per chunk.

Every execution mode runs ``step.advance``; they differ in how many iterations a chunk holds, whether
the stop rule is tested at each of them, and whether the chunk is compiled:

  mode                 chunk               stop tested              host reads          runs
  eager (default)      1 iteration         every iteration          every iteration     eager
  check_every: N       N (the last cut     at the chunk's last      every N and the cap eager
                       at the cap)         iteration (N, 2N, .., cap)
  no rule can fire     the cap             at the cap               once                eager
  (tol 0, no eta_min stop within the cap: ``read_schedule``)
  chunk: K             K                   every iteration          every K             compiled where it traces
  bookkeeping: fused   fpscale.solvers.fused's kernels stand in for the bookkeeping (the read schedules above)

A chunk's iterations after a stop, or past the cap, apply f and leave every sample and token as it was
(``torch.where``), so the iterate, damping, residuals, frozen tokens, ``retired_at``, the iteration count
and the stop reason are those of the eager loop in every mode, and so are the gradients (the unroll
backward differentiates through the selects). A compiled chunk keeps K fixed (no recompilation at the
cap): at most K - 1 applications of f after the stop are wasted (under ``agree: dp`` up to 2K - 1, once
per solve: the replay). After each chunk the host reads one small tensor [running, iterations, stop
reason, TP flags differ, DP k*].

Agreement with other ranks (fpscale.solvers.chunk_agree): the eager schedules agree every iteration
(TP: MAX of the flags; DP: SUM of the decision's counts); a ``chunk: K`` solve agrees once per chunk:
under ``agree: dp`` the chunk runs with the stop off except the cap, records its counts [K, 3], one SUM
all-reduce after it gives the first stopping iteration k*, to which the chunk is replayed from its
start where it ran past it; under TP the ranks' flags are checked once per chunk (an error naming
``solver.chunk`` if they differ), except for a consensus marked ``EveryIteration`` (fpsa's heads).

A ``chunk: K`` chunk is compiled with ``torch.compile(fullgraph=True, dynamic=False)`` where it traces as
one graph: a solve without autograd through the loop (the forward solve of implicit, phantom and jfb,
evaluation, Anderson mixing and ``sample_l2`` included), under TP and DP too. The iteration number, the
cap, ``min_iter``, the quantile limit and the DP replay's values enter as device scalars: neither a
different iteration count, nor training vs evaluation, nor a replay recompiles (tests/solvers/
test_chunked.py, test_chunk_agree.py count it). Elsewhere the chunk runs eager, one host read per chunk:
  unroll       autograd through K unrolled iterations
  adjoint      the adjoint's step is ``torch.autograd.grad`` of the recorded f, which dynamo does not trace
               in one graph: the first step found untraceable is remembered (by its code) and its chunks
               run eager from then on, said once
``solver.cuda_graph`` (CUDA): the compiled chunk with mode reduce-overhead (Inductor's CUDA graph trees,
``_replay``; ``check_cuda_graph`` refuses it off CUDA and under TP).
"""
from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Callable

import torch

from fpscale.solvers.anderson import min_iterations
from fpscale.solvers.chunk_agree import differs, first_stop, pack_flags, words_for
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.fused import fused_wanted, iterate_fused
from fpscale.solvers.loop_state import NEVER, Carry, IterateResult
from fpscale.solvers.rows import RowCompaction
from fpscale.solvers.stats import STOP_REASONS
from fpscale.solvers.step import MAX_ITER, NONFINITE, SolveContext, advance, start_state, stop_code
from fpscale.solvers.stop_rule import quantile_limit, read_schedule

COMPILE = True      # False: every chunk runs eager (the same function; tests of the semantics skip Inductor)
BACKEND = "inductor"   # tests counting graph breaks and recompilations (dynamo's) use aot_eager: no C++ build
_UNTRACEABLE: set = set()          # code objects of steps that did not trace as one graph
UNTRACEABLE_WHY: dict[str, str] = {}   # their qualified names -> the compiler's message (the benches record it)
_COMPILED: dict = {}               # (step code, backend, graphed) -> its compiled chunk


def _chunk(step, state, k0, cap, min_iter, limit, bad_at, cfg: SolverConfig, K: int, last_only: bool, real, prefix,
           state_reduce, group: int, consensus, agree, defer: bool, verify: bool, masked: bool = True):
    """K iterations of ``advance`` from iteration ``k0 + 1`` (``k0``, ``cap``, ``min_iter``, ``limit`` and
    ``bad_at`` device scalars). ``last_only``: the stop is tested at the chunk's last iteration only
    (check_every). ``defer`` (``agree: dp`` in a chunk): no stop but the cap, the local counts [K, 3]
    recorded for the agreement after the chunk; ``verify`` (TP): the flags packed as words; ``masked``
    False: the eager loop's chunk of one (``step.advance``). Returns (state, counts or None, words or None)."""
    if hasattr(step, "per_chunk"):          # a step that prepares once per chunk (backward.VjpStep)
        step = step.per_chunk()
    ctx = SolveContext(state_reduce=state_reduce, real=real, prefix=prefix, group=group)
    rows = []
    W = words_for(K) if verify else 0
    words = [torch.zeros(state.best.shape, dtype=torch.long, device=state.z.device) for _ in range(W)]
    nonfinite_words = [torch.zeros((), dtype=torch.long, device=state.z.device) for _ in range(W)]
    for i in range(K):
        state, counts, active = advance(step, state, k0 + (i + 1), i == 0, cfg, ctx, cap=cap, min_iter=min_iter,
                                        limit=limit, test=(i == K - 1) if last_only else True, consensus=consensus,
                                        agree=agree, bad_at=bad_at if defer else None, masked=masked)
        with torch.no_grad():
            if defer:
                rows.append(torch.stack([*counts.sums(), counts.nonfinite.long()]) * active)
            if verify:
                pack_flags(words, nonfinite_words, counts.flags, i, active)
    packed = torch.cat([torch.stack(nonfinite_words), torch.stack(words).flatten()]) if verify else None
    if not masked:                # the eager loop: the host reads the decision's numbers (``stop_code``)
        n_unconverged, movable = counts.sums()
        return state, torch.stack([n_unconverged, n_unconverged <= limit, movable == 0, counts.nonfinite]), packed
    return state, (torch.stack(rows) if defer else None), packed


def _compiled_chunk(code, graphed: bool = False) -> Callable:
    """The chunk compiled for the steps of one code object (a layer type's closure): a copy of ``_chunk``
    with its own code object, so each layer type has its own cache of graphs (dynamo's recompile limit
    counts per code object). ``graphed`` (``solver.cuda_graph``): mode reduce-overhead, CUDA graph trees."""
    if (code, BACKEND, graphed) not in _COMPILED:
        own = types.FunctionType(_chunk.__code__.replace(), _chunk.__globals__, "_chunk", _chunk.__defaults__)
        if graphed:         # Inductor's CUDA graph trees
            _COMPILED[code, BACKEND, graphed] = torch.compile(own, fullgraph=True, dynamic=False,
                                                              mode="reduce-overhead")
        else:
            _COMPILED[code, BACKEND, graphed] = torch.compile(own, fullgraph=True, dynamic=False, backend=BACKEND)
    return _COMPILED[code, BACKEND, graphed]


def _replay(compiled: Callable, args: tuple):
    """One replay of a captured chunk: a new step begins for the graph trees (the previous replay's outputs
    may be overwritten), so what the solve keeps is cloned out of the graph's pool."""
    torch.compiler.cudagraph_mark_step_begin()
    state, counts, words = compiled(*args)
    return (type(state)(*(None if t is None else t.clone() for t in state)),
            *(None if t is None else t.clone() for t in (counts, words)))


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


def run_loop(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig,
             context: SolveContext | None = None, *, quantile: float, carry: Carry | None = None,
             chunk: int | None = None, **fields) -> IterateResult:
    """Iterate ``step`` from ``z0`` in the schedule ``cfg`` names (module docstring): the forward solve, the
    adjoint and deep supervision's windows call this. ``context`` (or its fields as keywords: consensus,
    state_reduce, agree, real, prefix, group, min_iter, max_iter) is the call's ``SolveContext``;
    ``quantile`` the stop quantile p (at most floor(p B) samples stay unconverged); ``carry`` a previous
    call's ``IterateResult.carry`` to go on from; ``chunk`` overrides ``cfg.chunk`` (0: the eager schedules).
    Gradients flow through the loop only if grad mode is on (the unroll backward)."""
    ctx = dataclasses.replace(context or SolveContext(), **fields)
    cap = cfg.max_iter if ctx.max_iter is None else ctx.max_iter
    agree, consensus = ctx.agree, ctx.consensus
    limit = quantile_limit(quantile, z0.shape[0] * (agree.size if agree is not None else 1))
    low = max(ctx.min_iter, min_iterations(cfg, cap))        # the caller's (decoding) and the config's
    K = cfg.chunk if chunk is None else chunk
    if not K and fused_wanted(cfg, z0, group=ctx.group, carried=carry is not None):
        return iterate_fused(step, z0, cfg, every=read_schedule(cfg, cap), limit=limit, consensus=consensus,
                             state_reduce=ctx.state_reduce, max_iter=cap, real=ctx.real, agree=agree,
                             min_iter=low, prefix=ctx.prefix, count_entries=ctx.count_entries)
    dev = z0.device

    def scalar(value: int) -> torch.Tensor:
        return torch.full((), value, dtype=torch.long, device=dev)

    state = start_state(z0, cfg, ctx.group, carry, ctx.count_entries)
    if K:           # a chunk of K: every iteration tested, agreement once per chunk
        last_only, fixed = False, True
        per_iteration = consensus if getattr(consensus, "every_iteration", False) else None
        defer, verify, agree_each = agree is not None, consensus is not None and per_iteration is None, None
    else:           # eager / check_every: agreement every iteration
        K, last_only, fixed = read_schedule(cfg, cap) or cap, True, False
        per_iteration, defer, verify, agree_each = consensus, False, False, agree
    code = getattr(step, "__code__", None) or getattr(getattr(step, "per_chunk", None), "__code__", None)
    traced = fixed and COMPILE and not torch.is_grad_enabled() and code not in _UNTRACEABLE
    graphed = traced and cfg.cuda_graph
    if fixed and cfg.cuda_graph:        # the launch's check (check_cuda_graph), at the solve
        if not z0.is_cuda:
            check_cuda_graph(cfg, dev)
        if consensus is not None or ctx.state_reduce is not None:
            raise ValueError(f"solver.cuda_graph = true under tensor parallelism: {_TP_CAPTURE}")
    cap_t, low_t, lim_t, never = scalar(cap), scalar(low), scalar(limit), scalar(NEVER)
    masked = fixed or K > 1          # the eager loop (a chunk of one, read every iteration) needs no masks
    # the eager loop's row compaction (fpscale.solvers.rows): f leaves the rows whose entries are all frozen
    rows = None
    if RowCompaction.wanted(step, cfg, ctx, masked, z0.shape[0]):
        step = rows = RowCompaction(step, state.last_f is not None)

    def run(state, k0: int, length: int, cap_v, bad_at):
        nonlocal traced, graphed
        # device scalars where the chunk is traced (no recompilation per iteration count), else ints
        numbers = (scalar(k0), cap_v, low_t, lim_t) if traced or defer else (k0, cap, low, limit)
        args = (step, state, *numbers, bad_at, cfg, length, last_only, ctx.real, ctx.prefix,
                ctx.state_reduce, ctx.group, per_iteration, agree_each, defer, verify, masked)
        if traced:
            try:
                if graphed:
                    return _replay(_compiled_chunk(code, True), args)
                return _compiled_chunk(code)(*args)
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

    # chunk_schedule expected: the first read after the chunks covering the expected iterations (not under a
    # deferred DP agreement, whose replay needs a read per chunk)
    ahead = -(-min(ctx.expect, cap) // K) if fixed and not defer and ctx.expect else 1
    done, n, why, k0 = False, cap, MAX_ITER, 0
    while k0 < cap:
        length = K if fixed else min(K, cap - k0)
        begin = state
        state, counts, words = run(state, k0, length, cap_t, never)
        with torch.no_grad():
            mismatch = differs(consensus, words) if verify else state.running
        while ahead > 1 and k0 + length < cap:       # more chunks before the read (no read between them)
            ahead, k0 = ahead - 1, k0 + length
            state, counts, words = run(state, k0, length, cap_t, never)
            if verify:
                with torch.no_grad():
                    mismatch = mismatch | differs(consensus, words)
        ahead = 1
        if not masked:               # the eager loop: one read of the decision, the rule applied on the host
            with torch.no_grad():
                active = rows.remaining(begin.frozen, state.frozen) if rows is not None else None
                read = counts if active is None else torch.cat([counts.long(), active.sum().view(1)])
                unconverged, met, stalled, bad_now, *left = read.tolist()
            n = k0 + length
            code = stop_code(bool(bad_now), unconverged, bool(met), bool(stalled), n >= low)
            if code is not None:
                if code == NONFINITE:
                    state = begin        # the last finite iterate
                why, done = code, True
                break
            if rows is not None and active is not None:
                rows.shrink(active, left[0])
            k0 += length
            continue
        with torch.no_grad():
            if defer and agree is not None:                                 # DP: one all-reduce
                stopped, kstar, reason = first_stop(agree(counts), k0, cap_t, low_t, lim_t)
                running = ~stopped
            else:
                running, kstar, reason = state.running, state.iters, state.reason
            alive, n, why, bad, k_star = torch.stack([running.long(), state.iters, reason, mismatch.long(),
                                                      kstar]).tolist()     # the chunk's one read
        if verify and bad:
            raise RuntimeError(f"solver.chunk = {K} under tensor parallelism: the ranks of a TP group saw different "
                               f"stop flags in iterations {k0 + 1}..{k0 + K} (a collective or a step that is not "
                               "bitwise the same on every rank); the chunk agrees once per chunk and needs them "
                               "equal: set solver.chunk: 0 (the eager loop agrees every iteration)")
        if defer and not alive:      # the DP group stops at k*: the state there, replayed where the chunk ran past it
            if k_star < n or why == NONFINITE:
                state, _, _ = run(begin, k0, length, scalar(k_star), scalar(k_star) if why == NONFINITE else never)
            n, done = k_star, True
            break
        if not alive:
            done = True
            break
        k0 += length
    stopped_by = STOP_REASONS[why] if done else "max_iter"
    z = state.z
    if state.last_f is not None and stopped_by != "nonfinite" and n > 0:
        z = state.last_f             # Attractor's solve returns the last f(x) (fpscale.solvers.anderson)
    return IterateResult(z=z, iterations=n, stopped_by=stopped_by, token_res=state.token_res,
                         token_converged=state.token_res < cfg.tol, eta=state.eta,
                         carry=Carry(state.eta, state.best, state.patience_left, state.frozen, state.token_res),
                         retired_at=state.retired_at, entry_iters=state.entry_iters,
                         row_iterations=rows.row_iterations if rows is not None else None)
