"""What every looped layer shares: its solver settings, the consensus hook that parallelize
may set, the randomised cap of the current step, and the statistics of its last solve."""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.solvers import SolverConfig, SolverStats, solve


class FixedPointLayer(torch.nn.Module):
    """Base class: subclasses build ``f`` inside their ``forward`` and call ``self.fixed_point``."""

    def __init__(self, solver: SolverConfig):
        super().__init__()
        self.solver = solver
        self.consensus = None            # set by fpscale.parallel for tensor parallelism
        self.cap: int | None = None      # randomised per-step cap (training only)
        self.last_stats: SolverStats | None = None

    def fixed_point(self, f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> torch.Tensor:
        z, self.last_stats = solve(f, z0, self.solver, training=self.training, consensus=self.consensus,
                                   max_iter=self.cap if self.training else None)
        return z
