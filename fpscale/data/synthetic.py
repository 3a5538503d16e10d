"""Synthetic tasks, generated per global sample index (so they follow the same global order,
resume and data-parallel rules as real shards)."""
from __future__ import annotations

import numpy as np
import torch


class SyntheticTask:
    """``periodic``: a random motif of ``period`` tokens repeated; ``copy``: a random half, then
    the same half again. Sample i is a pure function of (seed, i)."""

    num_samples = 1 << 40     # effectively endless: epochs never wrap
    needs_shuffle = False     # sample i is already random: the order is the identity

    def __init__(self, task: str, vocab_size: int, seq_len: int, seed: int, period: int = 3):
        self.task, self.vocab, self.seq_len, self.seed, self.period = task, vocab_size, seq_len, seed, period

    def fingerprint(self) -> str:
        return f"synthetic:{self.task}:v{self.vocab}:p{self.period}"

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(index)])
        n = self.seq_len + 1
        if self.task == "periodic":
            motif = rng.integers(0, self.vocab, self.period)
            return np.resize(motif, n)
        half = rng.integers(0, self.vocab, (n + 1) // 2)
        return np.concatenate([half, half])[:n]

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]).astype(np.int64))
