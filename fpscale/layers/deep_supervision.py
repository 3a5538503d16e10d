"""Deep supervision with truncated-backprop windows (seed 004: Algorithm 2, App. D "Deep supervision").

``model.layers.N.deep_supervision.window: K`` on a fixed-point layer. A training forward with targets
then runs that layer's solve in windows of K iterations (Algorithm 1's damped step with patience, its
state carried from window to window):

    z <- z0 (the layer's start, 0 for the looped core);  losses <- []
    while the solver goes on:
        run K iterations of the solver from z                              (Algorithm 2, lines 3-6)
        if the solver stopped inside the window (or at its last iteration): leave the loop
        L_w <- CE(head(coda(z)), y): the rest of the model after the layer (its coda), the final
               norm and the head, as a full forward would; its gradient is taken through the
               window's K iterations only (truncated BPTT), into the layer's input too     (7-9)
        z <- detach(z)                                                                      (10)
    final window at the solver's stop z*: the configured backward mode (phantom: k steps from the
    detached z*, jfb, implicit), the coda and the head: L_final (App. D: "after the outer solver
    converges, a final iteration is performed with gradients enabled and its output is supervised")
    loss = L_final + sum_w L_w

How the losses combine: summed. Algorithm 2 calls MODELOPT.BACKWARD(L) once per window and steps the
optimizer once per batch, so the gradients of the windows add up; fpscale returns the sum, whose one
backward gives that total. The cross-entropy a run reports (``last_losses["ce"]``) is L_final's (what
evaluation measures); ``last_losses["deep_supervision"]`` is sum_w L_w, ``["windows"]`` their count.

Deviations from the paper (say where a run differs):
  - a window the solver stops in is not supervised on its own: the final window follows at once (App. D
    counts ceil(n / K) + 1 backward passes for n iterations; fpscale takes floor((n - 1) / K) + 1:
    the supervised windows are those the solver went on after). So a window spanning the whole solve
    gives the training step without deep supervision, loss and gradients (tests/layers/
    test_deep_supervision.py).
  - the windows' backward runs when the trainer calls it (one ``backward`` of the summed loss), not
    inside the forward: each supervised window is recomputed in that backward from its start state
    (``fpscale.layers.checkpointing.recompute``: its K iterations, the coda and the head run a second
    time), so the memory is one window's activations, as the paper's per-window backward, and the
    gradient is the paper's sum. What the trainer does (DeepSpeed's engine, ZeRO's hooks) is unchanged.
  - the solver reads its stop decision every iteration in the windows (``solver.execution.check_every`` is not
    applied) and runs its PyTorch bookkeeping (not the fused kernels): the windows go on from the
    carried state, which only the PyTorch loop takes.

Under tensor parallelism the windows follow the agreed stop (the consensus of every iteration), so
every rank of a TP group takes the same windows. Data-parallel ranks run their own solves; with ZeRO-3
the coda's parameters are gathered once per window over the DP group, so there the window count must be
agreed over DP too (``solver.forward.agree: dp``: the Trainer says so where it is missing).
"""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.errors import check
from fpscale.layers.checkpointing import recompute
from fpscale.solvers.chunked import run_loop
from fpscale.solvers.config import IMPLICIT_MODES, SolverConfig, key_of
from fpscale.solvers.loop_state import Carry, IterateResult, state_dtype
from fpscale.solvers.solve import differentiable, resolved, stats_of
from fpscale.solvers.stats import SolverStats
from fpscale.solvers.step import SolveContext, fresh_state


def check_solver(solver: SolverConfig, key: str, iterate_free: bool = False) -> None:
    """What a supervised layer's solver must be (errors name ``key``, the layer's solver section)."""
    check(solver.backward != "unroll", key_of("backward", key),
          "deep_supervision supervises its final window with the backward at the fixed point: phantom, jfb or "
          "implicit, got unroll (windows of the whole solve are deep_supervision.window >= solver.forward.max_iter)")
    check(solver.anderson == 0, key_of("anderson", key),
          f"deep_supervision carries Algorithm 1's damped step from window to window; Anderson mixing "
          f"(anderson = {solver.anderson}) has no such state: set anderson 0")
    check(not iterate_free, f"{key}", "deep_supervision needs a layer whose map reads its iterate "
          "(this layer's solve is one application: iterate_free)")


class Window:
    """One window of a supervised solve: from ``start`` (None: the layer's own z0) and ``carry``,
    at most ``cap`` iterations. The first run records what the solver did (``result``); a run after
    it (the recomputation in backward) replays exactly those iterations."""

    def __init__(self, start: torch.Tensor | None, carry: Carry | None, cap: int):
        self.start, self.carry, self.cap = start, carry, cap
        self.result: IterateResult | None = None


class Final:
    """The final window at the solver's stop: the backward mode at ``z`` (detached) with ``stats``."""

    def __init__(self, z: torch.Tensor, stats: SolverStats):
        self.z, self.stats = z, stats


def run_plan(layer, f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, real: torch.Tensor | None,
             plan) -> torch.Tensor:
    """What ``FixedPointLayer.fixed_point`` computes while the model drives it window by window."""
    cfg = resolved(layer.solver, z0, layer.solver.backward in IMPLICIT_MODES)
    ctx = SolveContext(consensus=layer.consensus(), state_reduce=layer.shards.state_reduce if layer.state_sharded
                       else None, agree=layer.dp_agree if cfg.agree == "dp" else None, real=real,
                       group=layer.entries_per_token)
    if isinstance(plan, Final):
        return differentiable(f, plan.z, cfg, plan.stats, ctx)
    start = (z0 if plan.start is None else plan.start).detach().to(state_dtype(z0.dtype))
    carry = plan.carry if plan.carry is not None else fresh_state(z0, cfg, ctx.group)
    replay = plan.result is not None
    result = run_loop(f, start, cfg, ctx, quantile=cfg.stop_quantile,
                      max_iter=plan.result.iterations if replay else plan.cap, carry=carry)
    if replay:
        if result.iterations != plan.result.iterations:
            raise RuntimeError(f"deep supervision: the recomputed window took {result.iterations} iterations, the "
                               f"forward {plan.result.iterations}: the layer's map is not deterministic")
    else:
        plan.result = result
    return result.z


def supervised(model) -> tuple[int, torch.nn.Module] | None:
    """(index in ``model.layers``, its fixed-point layer) of the entry with deep supervision on, or None."""
    for i, block in enumerate(model.layers):
        for m in block.modules():
            if getattr(m, "ds_window", 0) > 0:
                return i, m
    return None


def _with_plan(layer, plan, call):
    layer.window_plan = plan
    try:
        return call()
    finally:
        layer.window_plan = None


def deep_supervised_loss(model, tokens: torch.Tensor, targets: torch.Tensor, pad: torch.Tensor | None,
                         index: int, fp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(loss to minimise, final cross-entropy, sum of the windows' cross-entropies, windows): the
    training forward of ``model`` with its entry ``index`` supervised in windows (module docstring);
    ``fp`` is that entry's fixed-point layer (the entry itself, or inside its block)."""
    layer = model.layers[index]
    K = fp.ds_window
    h = model.hidden(tokens, pad=pad, stop=index)                     # the prelude, once
    rest = model.layers[index + 1:]
    kwargs = {} if pad is None else {"pad": pad}

    def decode(s: torch.Tensor) -> torch.Tensor:                     # coda, norm, head, loss
        return model.head_loss(model.hidden_from(s, index + 1, pad=pad), targets)

    cap = fp.cap or fp.solver.max_iter
    z, carry, done, windows = None, None, 0, []
    looped = list(model.looped_layers().values())
    while True:
        plan = Window(z, carry, min(K, cap - done))
        if done + K >= cap:          # the cap ends this window: it is the last, never supervised alone
            with torch.no_grad():
                _with_plan(fp, plan, lambda: layer(h, 0, None, **kwargs))
            result = plan.result
        else:
            def window(h_in, start, plan=plan):
                replay = plan.result is not None
                kept = [m.last_stats for m in looped] if replay else None
                plan.start = start
                s = _with_plan(fp, plan, lambda: layer(h_in, 0, None, **kwargs))
                stop = plan.result.stopped_by != "max_iter"
                loss = s.new_zeros((), dtype=torch.float32) if stop and not replay else decode(s)
                if kept is not None:       # the recomputation in backward leaves the forward's statistics
                    for m, st in zip(looped, kept):
                        m.last_stats = st
                return loss

            if z is None:          # window 1 starts at the layer's z0
                loss = recompute(lambda h_in, window=window: window(h_in, None), (layer, *rest), h)
            else:
                loss = recompute(window, (layer, *rest), h, z)
            result = plan.result
            if result.stopped_by == "max_iter":
                windows.append(loss)
        done += result.iterations
        z, carry = result.z.detach(), result.carry
        if result.stopped_by != "max_iter" or done >= cap:
            break
    stats = stats_of(result, cap, resolved(fp.solver, z, False).tol)
    stats.iterations, stats.windows, stats.window = done, len(windows), K
    s = _with_plan(fp, Final(z, stats), lambda: layer(h, 0, None, **kwargs))
    fp.last_stats = stats
    ce = decode(s)
    extra = sum(windows[1:], windows[0]) if windows else ce.new_zeros(())
    return ce + extra, ce, extra.detach(), len(windows)
