"""``solver.forward.agree: dp``: the looped layers' stop decisions taken over the data-parallel group.

By default each data-parallel rank stops its solves on its own micro-batch, and every optimizer step
waits for the slowest rank (the trainer logs the spread: ``iters_dp_max`` against ``iters_dp_mean``).
With ``agree: dp`` every iteration sums the decision's counts (unconverged samples, samples that can
still move, non-finite) over the DP group in one 3-int all-reduce, so the quantile is decided over
the global micro-batch, exactly as one process would decide it over all the group's samples, and
every rank runs the same iterations (tests/parallel/test_dp_agree.py: N ranks at micro-batch 1 =
one process with the N samples). Under TP the flags are first agreed over the TP group as always.

    attach(model, state)        # after parallelize; a no-op unless a layer's solver says agree: dp
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class DataParallelAgreement:
    """SUM of a small int64 tensor over the DP group (``fpscale.solvers.iterate.Agree``)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        dist.all_reduce(counts, group=self.group)
        return counts


def attach(model: torch.nn.Module, state) -> int:
    """Give every fixed-point layer whose solver says ``agree: dp`` the DP group's agreement (where
    there are several DP ranks); returns how many layers got it."""
    if state.dp_size <= 1:
        return 0
    agreement = DataParallelAgreement(state.dp_group, state.dp_size)
    n = 0
    for module in model.modules():
        solver = getattr(module, "solver", None)
        if hasattr(module, "dp_agree") and getattr(solver, "agree", "rank") == "dp":
            setattr(module, "dp_agree", agreement)
            n += 1
    return n
