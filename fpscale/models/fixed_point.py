"""What every looped layer shares: its solver settings, the seam where its shards meet
(``self.shards``), the randomised cap of the current step, and the statistics of its last solve."""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.models.common import Unsharded
from fpscale.solvers import SolverConfig, SolverStats, solve


class FixedPointLayer(torch.nn.Module):
    """Base class: subclasses build ``f`` inside their ``forward`` and call ``self.fixed_point``."""

    def __init__(self, solver: SolverConfig):
        super().__init__()
        self.solver = solver
        self.shards = Unsharded()        # replaced by fpscale.parallel for tensor parallelism
        self.state_sharded = False       # True where the solved state is split over the shards
        self.cap: int | None = None      # randomised per-step cap (training only)
        self.last_stats: SolverStats | None = None

    def fixed_point(self, f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> torch.Tensor:
        reduce = self.shards.state_reduce if self.state_sharded else None
        z, self.last_stats = solve(f, z0, self.solver, training=self.training, consensus=self.shards.consensus,
                                   state_reduce=reduce, max_iter=self.cap if self.training else None)
        return z
