"""A looped layer that iterates to a fixed point: its solver settings, the randomised cap of the
current training step, and the statistics of its last solve (what every looped layer shares, its
shards, step and evaluation depth, is in fpscale.layers.looping)."""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.layers.deep_supervision import run_plan
from fpscale.layers.looping import LoopedLayer
from fpscale.layers.step_cache import StepCache
from fpscale.solvers import SolverConfig, SolverStats, solve
from fpscale.solvers.chunk_agree import EveryIteration


class FixedPointLayer(LoopedLayer):
    """Base class: subclasses build ``f`` inside their ``forward`` and call ``self.fixed_point``.

    ``f`` receives the iterate in float32 (float64 in float64 models) and keeps the elementwise
    algebra on it there; its heavy products run in the weights' dtype (fpscale.solvers.precision).
    ``fixed_point`` returns z* in that float32 state dtype: the layer casts where it leaves.

    A subclass whose ``f`` never reads its iterate (FP-Mamba as a plain Mamba baseline:
    ``FPMambaSpec.iterate_free``) sets ``iterate_free``: its solve is then one application of f,
    the differentiable one (``fpscale.solvers.solve.apply_once``), and its FLOPs count one
    application forward and its backward (``backward_mode`` ``once``).
    """

    def __init__(self, solver: SolverConfig):
        super().__init__()
        self.solver = solver
        self.state_sharded = False       # True where the solved state is split over the shards
        self.iterate_free = False        # True where f never reads its iterate: f(z0) is z*
        self.entries_per_token = 1       # entries of the solved state per token (fpsa halting: head: its heads)
        # True where TP ranks hold different entries of a token (fpsa's heads): the stop flags then differ
        # by rank, and solver.execution.chunk agrees them every iteration
        self.entries_split = False
        self.cap: int | None = None      # randomised per-step cap (training only)
        self.dp_agree = None             # the DP stop counts (solver.forward.agree: dp; fpscale.parallel.agree)
        self.last_stats: SolverStats | None = None
        self.ds_window = 0               # deep supervision's window (model.layers.N.deep_supervision.window)
        self.window_plan = None          # set while fpscale.layers.deep_supervision drives the solve

    @property
    def backward_mode(self) -> str:      # type: ignore[override]
        """The solver's backward mode; ``once`` for an iterate-free layer, whose one application
        of f is both the forward and what autograd differentiates (fpscale.train.flops)."""
        return "once" if self.iterate_free else self.solver.backward

    @property
    def phantom_steps(self) -> int:      # type: ignore[override]
        return self.solver.phantom_steps

    def compiled(self, step: Callable) -> Callable:
        """``step`` (a bound method taking the iterate and tensors, one application of f) under
        torch.compile when ``solver.execution.compile`` is on, else ``step`` itself. Compiled once per layer
        with dynamic=False and called from the solver's Python loop: the iteration count is not
        part of the graph, so a solve of another length reuses it.

        With the implicit backward, the one application of f under grad (the one the adjoint
        differentiates) stays eager: the adjoint takes vector-Jacobian products with respect to
        the iterate alone, which eager autograd prunes to, while a compiled backward computes the
        gradients of every input (the weights too) in each adjoint iteration (fpsa at d 256,
        T 256 on a CPU: 19.5 ms against 15.9 ms per product)."""
        if not self.solver.compile:
            return step
        cache = self.__dict__.setdefault("_compiled_steps", {})
        name = step.__name__
        if name not in cache:
            cache[name] = torch.compile(step, dynamic=False)
        compiled = cache[name]
        if self.solver.backward not in ("implicit", "neumann1"):
            return compiled

        def no_grad_compiled(*args, **kwargs):
            return (step if torch.is_grad_enabled() else compiled)(*args, **kwargs)

        return no_grad_compiled

    def consensus(self):
        """The TP group's agreement of the stop flags (None without TP); where the ranks hold different
        entries of a token (``entries_split``), marked to be taken every iteration by a chunked solve
        (fpscale.solvers.chunk_agree.EveryIteration: one wrapper per seam, so a compiled chunk keeps its graph)."""
        consensus = self.shards.consensus
        if consensus is None or not self.entries_split:
            return consensus
        cached = self.__dict__.get("_every_iteration")
        if cached is None or cached.consensus != consensus:
            cached = self.__dict__["_every_iteration"] = EveryIteration(consensus)
        return cached

    def expected_iterations(self) -> int | None:
        """``solver.execution.chunk_schedule: expected``: the iterations the previous solve took (None: no hint)."""
        if self.solver.chunk_schedule != "expected" or self.last_stats is None:
            return None
        return self.last_stats.iterations

    def step_cache(self, cache: dict | None) -> StepCache:
        """This forward's view of its decoding cache in the layer's ``decode_cache`` mode."""
        return StepCache(cache, fixed=self.decode_cache == "fixed_point", capacity=self.token_capacity)

    def fixed_point(self, f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor,
                    real: torch.Tensor | None = None, step_cache: StepCache | None = None,
                    count_entries: bool = False, rows: Callable | None = None) -> torch.Tensor:
        """The layer's output for the solve of f from z0 (z*, or f(z*) after it where the backward
        mode's forward applies it: ``SolverConfig.eval_output``); ``real`` [B, T] marks the real
        tokens of left-padded rows (padding never holds up the stop test). ``step_cache``
        (decoding): f reads and records per-iteration entries (fpscale.layers.step_cache); the
        solve covers the past's iterations and f is applied to z* once more where the output
        step did not record the final entry. ``count_entries``: ``last_stats.entry_iterations`` counts
        each entry's iterations (SolveContext). ``rows(index)`` (decoding): f on the rows ``index`` alone, which
        the solve uses to compact its batch with ``decode_compact`` on (fpscale.solvers.rows; both cache modes);
        elsewhere it is not offered and f runs on every row."""
        if self.window_plan is not None:          # a window of a supervised solve (training only)
            return run_plan(self, f, z0, real, self.window_plan)
        reduce = self.shards.state_reduce if self.state_sharded else None
        if rows is not None and step_cache is not None and not step_cache.static \
                and self.decode_compact:      # (a static cache keeps every shape: no compaction)
            f = _with_rows(f, rows)
        z, self.last_stats = solve(f, z0, self.solver, training=self.training, consensus=self.consensus(),
                                   state_reduce=reduce, max_iter=self.cap if self.training else self.eval_depth,
                                   real=real, iterate_free=self.iterate_free,
                                   agree=self.dp_agree if self.training and self.solver.agree == "dp" else None,
                                   min_iter=step_cache.min_iter if step_cache is not None else 0,
                                   prefix=step_cache.prefix if step_cache is not None else None,
                                   group=self.entries_per_token, expect=self.expected_iterations(),
                                   count_entries=count_entries,
                                   on_final=step_cache.on_final if step_cache is not None else None)
        if step_cache is not None:
            step_cache.retired_at = self.last_stats.retired_at
            if not step_cache.finals:
                step_cache.on_final()
                with torch.no_grad():
                    f(z.detach())
        return z


def _with_rows(f: Callable, rows: Callable) -> Callable:
    """f offering ``f.rows(index)`` (fpscale.solvers.rows)."""
    def mapped(z):
        return f(z)
    mapped.rows = rows       # type: ignore[attr-defined]
    return mapped
