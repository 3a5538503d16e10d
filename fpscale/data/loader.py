"""The global data order and each data-parallel rank's share of it.

The stream is defined over *global* sample positions: position p lies in epoch
e = p // N at offset p % N and reads sample perm_e[p % N], where perm_e is a permutation of the
N samples seeded by (seed, e). Step s consumes positions [s*G, (s+1)*G) for a global batch of G
samples; DP rank r takes the r-th contiguous slice of G / dp. So the union over ranks is the
same global batch for every DP size, and resuming at ``consumed_samples`` continues the very
same stream. The whole loader state is one small record (:class:`LoaderState`). A blend of
sources brings its own order of global positions (fpscale/data/blend.py), cut the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fpscale.errors import DataError


@dataclass
class LoaderState:
    consumed_samples: int
    seed: int
    fingerprint: str


class GlobalOrder:
    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise DataError("the dataset holds no complete sample")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle

    @lru_cache(maxsize=2)
    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        if not self.shuffle:
            return pos % self.num_samples
        epochs, offsets = pos // self.num_samples, pos % self.num_samples
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out


def global_order(dataset, seed: int):
    """The dataset's own order when it defines one (a blend: fpscale/data/blend.py), else
    :class:`GlobalOrder` over its samples."""
    if hasattr(dataset, "order"):
        return dataset.order(seed)
    return GlobalOrder(dataset.num_samples, seed, getattr(dataset, "needs_shuffle", True))


class DistributedBatches:
    """Yields this rank's micro-batches [micro, seq_len + 1] in global order."""

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, consumed_samples: int = 0):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} "
                             f"x data-parallel size {dp_size}")
        self.dataset, self.global_batch, self.micro = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.order = global_order(dataset, seed)
        self.consumed_samples = consumed_samples

    def state(self) -> LoaderState:
        return LoaderState(self.consumed_samples, self.seed, self.dataset.fingerprint())

    def rank_indices(self, consumed: int) -> np.ndarray:
        share = self.global_batch // self.dp_size
        return self.order.indices(consumed + self.dp_rank * share, share)

    def next_global_batch(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next global batch; advances consumed_samples."""
        out = self.peek_global_batch()
        self.consumed_samples += self.global_batch
        return out

    def peek_global_batch(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next global batch, without advancing (the trainer's prefetch)."""
        idx = self.rank_indices(self.consumed_samples)
        return [self.dataset.batch(idx[i:i + self.micro]) for i in range(0, len(idx), self.micro)]


def validation_batches(dataset, batch_size: int, num_batches: int, dp_rank: int = 0,
                       dp_size: int = 1) -> list[tuple[torch.Tensor, bool]]:
    """This rank's validation batches as ``(batch, counted)``: the first samples in order, cut
    into the same whole batches on any DP size (a looped layer's solve depends on which samples
    share its batch) and dealt round-robin. Every rank runs the same number of forwards, since
    under ZeRO-3 each forward all-gathers parameters with every rank: a rank whose turn has no
    batch left runs the first batch again, not counted (``counted`` False)."""
    n = min(batch_size * num_batches, dataset.num_samples)
    batches = [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    rounds = -(-len(batches) // dp_size)
    out = []
    for r in range(rounds):
        i = r * dp_size + dp_rank
        out.append((dataset.batch(batches[i]), True) if i < len(batches) else (dataset.batch(batches[0]), False))
    return out
