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
               p_t = g_1 g_2 ... g_t (p_t = p_{t-1} o g_t, ``compose``); needs vocab >= |G|.
               The authors' conventions (dr-faustus/fp-rnn data/word_problem/dataset.py and
               word_problem_exp/main.py; seed 002 App. E.2), each an option, off by default:
                 start_token     a start token BOS = |G| before the word (their tokenizer's
                                 template, dataset.py lines 148-153, on the inputs and on the
                                 targets: the target at BOS is BOS); the example is seq_len + 1 long
                 short_fraction  the share of words of length 2, right-padded with PAD = |G| + 1
                                 (their training set concatenates the length-2 file, every one of
                                 the |G|^2 words, with the length-k sample, dataset.py lines 121-129
                                 and 181-205; pad_collate pads, lines 77-103): ``authors_short_fraction``
                 score_specials  the targets at BOS and PAD are scored (their loss is the plain
                                 cross-entropy over every position, main.py line 176, with no
                                 ignore index); off: those targets are -100
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


def authors_short_fraction(name: str, k_words: int = 16_000_000, train_split: float = 0.8) -> float:
    """The share of length-2 words in the authors' training set: all |G|^2 of them beside the
    train split of ``k_words`` sampled words of the training length (seed 002 App. E.2: 16M words
    of length 16, split 4:1; their generate_data.py writes every word when no sample count is given).
    For S3 that is 36 in 12.8M (2.8e-6), for A5 3,600 (2.8e-4), for S5 14,400 (1.1e-3)."""
    short = len(group_elements(name)) ** 2
    return short / (short + train_split * k_words)


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
                 min_len: int = 1, max_len: int = 0, distractors: int = 0, start_token: bool = False,
                 short_fraction: float = 0.0, score_specials: bool = False):
        self.task, self.vocab, self.seq_len, self.seed, self.period = task, vocab_size, seq_len, seed, period
        self.min_len, self.max_len, self.distractors = min_len, max_len or seq_len // 2, distractors
        self.start_token, self.short_fraction, self.score_specials = start_token, short_fraction, score_specials
        self._check()

    @property
    def specials(self) -> int:
        """How many ids above the group's elements the group task uses (BOS, PAD)."""
        return int(self.start_token) + int(self.short_fraction > 0)

    def _check(self) -> None:
        known = ("periodic", "copy") + ALIGNED_TASKS
        if self.task not in known:
            raise DataError(f"unknown synthetic task {self.task!r}: one of {known}")
        conventions = self.start_token or self.short_fraction or self.score_specials
        if conventions and self.task not in GROUP_TASKS:
            raise DataError(f"start_token, short_fraction and score_specials are options of the group tasks "
                            f"{GROUP_TASKS}, not of {self.task!r}")
        if not 0.0 <= self.short_fraction <= 1.0:
            raise DataError(f"short_fraction must be in [0, 1], got {self.short_fraction}")
        if self.task in GROUP_TASKS and self.vocab < len(group_elements(self.task)) + self.specials:
            raise DataError(f"task {self.task} has {len(group_elements(self.task))} elements"
                            f"{f' and {self.specials} special tokens' if self.specials else ''}: vocab_size "
                            f"{self.vocab} is too small")
        if self.short_fraction > 0 and self.seq_len < 2:
            raise DataError(f"short_fraction pads words of length 2 to seq_len, got seq_len {self.seq_len}")
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
        if not self.aligned:
            return base
        extra = (f":bos{int(self.start_token)}:short{self.short_fraction:g}:all{int(self.score_specials)}"
                 if self.start_token or self.short_fraction or self.score_specials else "")
        return f"{base}:l{self.min_len}-{self.max_len}:k{self.distractors}{extra}"

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
            if not (self.start_token or self.short_fraction):
                return word, group_products(self.task, word)
            return self._with_conventions(rng, word)
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

    def _with_conventions(self, rng: np.random.Generator, word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A group word with the authors' conventions (module docstring): a length-2 word padded
        with PAD with probability ``short_fraction``, BOS in front with ``start_token``."""
        n_elems = len(group_elements(self.task))
        bos, pad = n_elems, n_elems + int(self.start_token)
        special_target = (lambda tok: tok) if self.score_specials else (lambda tok: IGNORE)
        inputs, targets = word.copy(), group_products(self.task, word)
        if self.short_fraction and rng.random() < self.short_fraction:
            inputs[2:] = pad
            targets[2:] = special_target(pad)
        if self.start_token:
            inputs = np.concatenate([[bos], inputs])
            targets = np.concatenate([[special_target(bos)], targets])
        return inputs.astype(np.int64), targets.astype(np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]).astype(np.int64))

    def examples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, seq_len], targets [B, seq_len]) of ``indices``."""
        pairs = [self.example(i) for i in indices]
        return (torch.from_numpy(np.stack([p[0] for p in pairs]).astype(np.int64)),
                torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.int64)))
