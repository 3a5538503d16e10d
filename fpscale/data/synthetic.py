"""Synthetic tasks, generated per global sample index (so they follow the same global order,
resume and data-parallel rules as real shards). Sample i is a pure function of (seed, i).

Next-token tasks (``sample(i)``: seq_len + 1 tokens; the trainer's inputs/targets are its shift):
  periodic     a random motif of ``period`` tokens repeated (learnable by every layer type)
  copy         a random half, then the same half again

Position-aligned tasks (``example(i)`` -> (inputs [seq_len], targets [seq_len]); a target of
-100 is not scored, as in ``LoopedLM.cross_entropy``). These are the seeds' probes, used by
``experiments/``; the next-token trainer (``data.task``) does not train them:
  s3, a4, a5   group word problems (Merrill et al.; seed 002 Figs. 1-4): the inputs are elements
               g_1 .. g_T of the group (ids 0 .. |G|-1), the target at t the product so far
               p_t = g_1 g_2 ... g_t (p_t = p_{t-1} o g_t, ``compose``); needs vocab >= |G|
  copy_sep     Jelassi et al.'s copy (seed 002 Table 1 / Fig. 2b): x_1..x_n SEP x_1..x_n with
               n uniform in [min_len, max_len]; targets only after SEP; padded to seq_len with PAD.
               Tokens: content 0 .. vocab-3, SEP = vocab-2, PAD = vocab-1; seq_len >= 2 max_len
  induction    randomised induction with distractors (seed 000 Sec. 3.1): a true pair (A, B) in
               the first half, ``distractors`` pairs (A, D) with D != B after it, filler tokens
               != A elsewhere, and the query A, MASK at the end; the only target is B, at MASK.
               Tokens: content 0 .. vocab-2, MASK = vocab-1
"""
from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import torch

from fpscale.errors import DataError

GROUP_TASKS = ("s3", "a4", "a5")
ALIGNED_TASKS = GROUP_TASKS + ("copy_sep", "induction")
IGNORE = -100


def _parity(perm: tuple[int, ...]) -> int:
    """0 for an even permutation, 1 for an odd one (by counting inversions)."""
    return sum(perm[i] > perm[j] for i in range(len(perm)) for j in range(i + 1, len(perm))) % 2


@lru_cache(maxsize=None)
def group_elements(name: str) -> tuple[tuple[int, ...], ...]:
    """The elements of S3, A4 or A5 as permutation tuples, in lexicographic order (id = position)."""
    if name not in GROUP_TASKS:
        raise ValueError(f"unknown group {name!r}: one of {GROUP_TASKS}")
    n = {"s3": 3, "a4": 4, "a5": 5}[name]
    perms = list(itertools.permutations(range(n)))
    return tuple(p for p in perms if name.startswith("s") or _parity(p) == 0)


def compose(p: tuple[int, ...], g: tuple[int, ...]) -> tuple[int, ...]:
    """(p o g)(i) = p(g(i)): apply g first, then p."""
    return tuple(p[g[i]] for i in range(len(p)))


@lru_cache(maxsize=None)
def cayley_table(name: str) -> np.ndarray:
    """table[i, j] = id of element_i o element_j."""
    elems = group_elements(name)
    index = {e: i for i, e in enumerate(elems)}
    return np.array([[index[compose(a, b)] for b in elems] for a in elems], dtype=np.int64)


def group_products(name: str, word: np.ndarray) -> np.ndarray:
    """Prefix products p_t = g_1 o ... o g_t of a word of element ids (the targets of the task)."""
    table = cayley_table(name)
    out = np.empty(len(word), dtype=np.int64)
    p = int(word[0])
    out[0] = p
    for t in range(1, len(word)):
        p = int(table[p, word[t]])
        out[t] = p
    return out


class SyntheticTask:
    """A synthetic task (module docstring). ``min_len``/``max_len`` are copy_sep's string lengths,
    ``distractors`` induction's K."""

    num_samples = 1 << 40     # effectively endless: epochs never wrap
    needs_shuffle = False     # sample i is already random: the order is the identity

    def __init__(self, task: str, vocab_size: int, seq_len: int, seed: int, period: int = 3,
                 min_len: int = 1, max_len: int = 0, distractors: int = 0):
        self.task, self.vocab, self.seq_len, self.seed, self.period = task, vocab_size, seq_len, seed, period
        self.min_len, self.max_len, self.distractors = min_len, max_len or seq_len // 2, distractors
        self._check()

    def _check(self) -> None:
        known = ("periodic", "copy") + ALIGNED_TASKS
        if self.task not in known:
            raise DataError(f"unknown synthetic task {self.task!r}: one of {known}")
        if self.task in GROUP_TASKS and self.vocab < len(group_elements(self.task)):
            raise DataError(f"task {self.task} has {len(group_elements(self.task))} elements: vocab_size "
                             f"{self.vocab} is too small")
        if self.task == "copy_sep":
            if not (1 <= self.min_len <= self.max_len and 2 * self.max_len <= self.seq_len and self.vocab >= 3):
                raise DataError(f"copy_sep needs 1 <= min_len <= max_len, 2 max_len <= seq_len and vocab >= 3, got "
                                 f"{self.min_len}, {self.max_len}, {self.seq_len}, {self.vocab}")
        if self.task == "induction":
            room = (self.seq_len - 4) // 2          # pair slots besides the true pair and the query
            if self.vocab < 4 or self.distractors > room - 1 or self.seq_len < 6:
                raise DataError(f"induction: {self.distractors} distractor pairs need seq_len >= "
                                 f"{2 * self.distractors + 6} and vocab >= 4, got {self.seq_len}, {self.vocab}")

    @property
    def aligned(self) -> bool:
        return self.task in ALIGNED_TASKS

    def fingerprint(self) -> str:
        base = f"synthetic:{self.task}:v{self.vocab}:p{self.period}"     # unchanged for the next-token tasks
        return f"{base}:l{self.min_len}-{self.max_len}:k{self.distractors}" if self.aligned else base

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(index)])

    def sample(self, index: int) -> np.ndarray:
        """seq_len + 1 tokens of a next-token task."""
        if self.aligned:
            raise ValueError(f"task {self.task} has position-aligned targets: use example()/examples()")
        rng = self._rng(index)
        n = self.seq_len + 1
        if self.task == "periodic":
            motif = rng.integers(0, self.vocab, self.period)
            return np.resize(motif, n)
        half = rng.integers(0, self.vocab, (n + 1) // 2)
        return np.concatenate([half, half])[:n]

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each seq_len long; targets of IGNORE are not scored."""
        if not self.aligned:
            s = self.sample(index)
            return s[:-1], s[1:]
        rng, T = self._rng(index), self.seq_len
        if self.task in GROUP_TASKS:
            word = rng.integers(0, len(group_elements(self.task)), T)
            return word, group_products(self.task, word)
        if self.task == "copy_sep":
            sep, pad = self.vocab - 2, self.vocab - 1
            n = int(rng.integers(self.min_len, self.max_len + 1))
            x = rng.integers(0, self.vocab - 2, n)
            inputs = np.full(T, pad, dtype=np.int64)
            targets = np.full(T, IGNORE, dtype=np.int64)
            inputs[:2 * n] = np.concatenate([x, [sep], x[:-1]])
            targets[n:2 * n] = x
            return inputs, targets
        # induction
        mask, content = self.vocab - 1, self.vocab - 1
        a = int(rng.integers(0, content))
        b = int((a + 1 + rng.integers(0, content - 1)) % content)           # b != a
        fill = (a + 1 + rng.integers(0, content - 1, T)) % content          # filler != a
        seq = fill.astype(np.int64)
        slots = (T - 2) // 2                        # pair slots 0 .. slots-1 at positions 2s, 2s+1
        k = self.distractors
        first = int(rng.integers(0, max(1, min(slots // 2, slots - k))))   # true pair in the first half
        later = rng.choice(np.arange(first + 1, slots), size=k, replace=False) if k else np.array([], int)
        seq[2 * first], seq[2 * first + 1] = a, b
        for s in later:
            d = int((b + 1 + rng.integers(0, content - 1)) % content)       # d != b (may equal a: rare, harmless)
            d = d if d != a else int((d + 1) % content) if (d + 1) % content != b else int((d + 2) % content)
            seq[2 * s], seq[2 * s + 1] = a, d
        seq[T - 2], seq[T - 1] = a, mask
        targets = np.full(T, IGNORE, dtype=np.int64)
        targets[T - 1] = b
        return seq, targets

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]).astype(np.int64))

    def examples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, seq_len], targets [B, seq_len]) of ``indices``."""
        pairs = [self.example(i) for i in indices]
        return (torch.from_numpy(np.stack([p[0] for p in pairs]).astype(np.int64)),
                torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.int64)))
