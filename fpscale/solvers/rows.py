"""Row compaction: a solve's map stops running on the rows (samples) whose entries are all frozen.

Cached decoding (fpscale.models.generate) solves one new token per row, the rows of a batch together. With
``solver.forward.decisions: token`` a row's token freezes when it converges (or stalls), but f still runs on
every row until the slowest one is done. A row's f reads only its own inputs, its own iterate and its own past,
so once the row froze, what it computes stops changing: it can leave the batch. The eager loop (fpscale.solvers.
chunked ``run_loop``, the default schedule) then gathers the rows still active and runs f on them alone; the
bookkeeping (``step.advance``: residuals, damping, Anderson's small solves, freezing, counts) stays on every
row, the rows that left get their last f(z) back (their iterate is held), so the solve's output, statistics
and per-entry counts keep their shape and meaning.

    f.rows = lambda index: f_restricted      # the layer's map on rows ``index`` ([n] long, of the whole batch)
    z, stats = solve(f, z0, config)          # stats.row_iterations: f's rows summed over the loop's calls

Where: a map with ``rows`` (the looped layers' decoding maps with ``decode.compact`` on, both cache modes:
fpsa, looped, fpmamba, fpmamba2, attractor), the eager loop (one iteration per host read: not ``check_every`` > 1,
not ``solver.chunk``, not the fused bookkeeping, not inside a model under ``torch.compile``: those keep static
shapes), ``decisions: token``, no gradient, no TP consensus, no split state and no DP agreement (decoding runs
in one process). Everything else runs f on every row as before (``RowCompaction.wanted``).

Why a frozen row's f stops changing. ``fixed_point`` cache: the past is one entry per token, read at every
iteration. ``exact`` cache (fpscale.layers.step_cache): f's call j reads the past's entry j and records the
row's own, but a token freezes only once every token before it is done (the prefix rule), at or after the past's
``prefix``, the iteration from which the past's entries no longer change (an entry list ends with its last
entry, read for every later j): from the iteration a row froze its calls read the same past and the same
iterate, so its entries at every later call are those of the application to z* after the loop (which runs on
every row). The restricted map reads and records through ``StepCache.rows(index)`` (those rows of the past's
entry j at call j), and ``StepCache.store`` gives the rows that left their final entry at the calls they missed,
so the cache is the one the uncompacted solve writes.

When: after an iteration, if the rows still active are at most half of those f ran on (``SHRINK``), f is
restricted to them (``f.rows``: the layer slices its per-row inputs, and in fixed_point mode its cache views,
once, not per iteration). Which rows are done: those whose entries were all frozen before the iteration just
run where the solve returns its last f(z) (the Attractor variant of Anderson: the row's last f(z) is then
f(z*) itself; SolverConfig.validate pairs it with ``decisions: sample``, outside this rule), else those frozen
after it. A restricted f computes the same rows as the whole-batch f up to the rounding of batched products of
another size (tests/models/test_decode_rows.py: within 2e-5 in float32, 1e-10 in float64).
"""
from __future__ import annotations

from typing import Callable

import torch

SHRINK = 0.5       # restrict f once the active rows are at most this fraction of the rows it runs on


class RowCompaction:
    """The eager loop's step: f on the active rows, the others' last f(z) filled in; counts f's rows."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], keep_last_f: bool):
        self.f, self.current = f, f
        self.index: torch.Tensor | None = None       # the rows f runs on (None: all)
        self.fill: torch.Tensor | None = None        # the last f(z) of every row
        self.keep_last_f = keep_last_f
        self.row_iterations = 0
        self.compactions = 0

    @staticmethod
    def wanted(step, cfg, ctx, masked: bool, batch: int) -> bool:
        """Whether this solve compacts its rows (module docstring, "Where"; a batch of one has none to drop)."""
        return (batch > 1 and getattr(step, "rows", None) is not None and not masked and cfg.decisions == "token"
                and not torch.is_grad_enabled() and ctx.consensus is None and ctx.state_reduce is None
                and ctx.agree is None and not torch.compiler.is_compiling())

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            fz = self.f(z)
            self.row_iterations += z.shape[0]
        else:
            assert self.fill is not None         # a restriction follows a call on every row
            part = self.current(z.index_select(0, self.index))
            fz = self.fill.index_copy(0, self.index, part.to(self.fill.dtype))
            self.row_iterations += self.index.numel()
        self.fill = fz.detach()
        return fz

    def remaining(self, frozen_before: torch.Tensor, frozen_after: torch.Tensor) -> torch.Tensor:
        """[B] bool on the device: the rows still active after an iteration (module docstring, "When")."""
        frozen = frozen_before if self.keep_last_f else frozen_after
        return ~frozen.flatten(1).all(1)

    def shrink(self, active: torch.Tensor, count: int) -> None:
        """Restrict f to the ``active`` rows ([B] bool; ``count`` of them, read with the loop's decision)
        where they are at most ``SHRINK`` of the rows f runs on now."""
        running = active.shape[0] if self.index is None else self.index.numel()
        if count == 0 or count > SHRINK * running:
            return
        self.index = active.nonzero()[:, 0]
        self.current = self.f.rows(self.index)       # type: ignore[attr-defined]
        self.compactions += 1
