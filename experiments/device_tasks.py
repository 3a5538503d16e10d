"""The seeds' synthetic tasks of ``fpscale.data.synthetic`` drawn as whole batches on a device (issue 50):
``SyntheticTask`` builds one example at a time in NumPy (a host loop per word: at a GPU's step rate the
batch would cost as much as the step), these draw the same distributions with torch on the device, so a
GPU run carries no data. Each has ``examples(indices)`` -> (inputs, targets) like ``SyntheticTask`` (only
``len(indices)`` is used: a batch is the generator's next draw, reproducible from its seed), so
``experiments.common.eval_aligned`` evaluates on them.

  GroupWords       s3 / a4 / a5 word problems: uniform words, targets the prefix products of
                   ``cayley_table`` (computed as a log-depth scan, the group product being associative),
                   with the authors' conventions of ``SyntheticTask._with_conventions`` (BOS in front,
                   a share of length-2 words padded with PAD, the specials' targets scored or not)
  InductionBatches randomised induction with distractors (``SyntheticTask.example``'s induction branch,
                   the same draws vectorised); ``mixed`` splits a batch evenly over several K (issue 30's
                   training mix, induction.MixedK)

tests/experiments/test_gpu_tables.py holds each to the rule ``SyntheticTask`` states.
"""
from __future__ import annotations

import torch

from fpscale.data.synthetic import IGNORE, cayley_table, group_elements


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def prefix_products(table: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """p_t = g_1 o ... o g_t for a batch of words [B, T] of element ids (Hillis-Steele: log2 T gathers)."""
    n = table.shape[0]
    p, shift = word.clone(), 1
    while shift < word.shape[1]:
        p = torch.cat([p[:, :shift], (table.flatten()[p[:, :-shift] * n + p[:, shift:]])], dim=1)
        shift *= 2
    return p


class GroupWords:
    """Words of ``length`` elements of ``group`` (ids 0 .. |G|-1), their prefix products as targets."""

    def __init__(self, group: str, length: int, device, seed: int, start_token: bool = False,
                 short_fraction: float = 0.0, score_specials: bool = False):
        self.n = len(group_elements(group))
        self.length, self.device = length, torch.device(device)
        self.table = torch.as_tensor(cayley_table(group), device=self.device)
        self.start_token, self.short_fraction, self.score_specials = start_token, short_fraction, score_specials
        self.bos, self.pad = self.n, self.n + int(start_token)
        self.g = _generator(self.device, seed)

    def examples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(indices)
        word = torch.randint(0, self.n, (B, self.length), generator=self.g, device=self.device)
        inputs, targets = word, prefix_products(self.table, word)
        if self.short_fraction > 0:                      # a length-2 word padded with PAD
            short = torch.rand(B, generator=self.g, device=self.device) < self.short_fraction
            tail = short[:, None] & (torch.arange(self.length, device=self.device) >= 2)
            inputs = inputs.masked_fill(tail, self.pad)
            targets = targets.masked_fill(tail, self.pad if self.score_specials else IGNORE)
        if self.start_token:
            bos = torch.full((B, 1), self.bos, dtype=torch.long, device=self.device)
            inputs = torch.cat([bos, inputs], 1)
            targets = torch.cat([bos if self.score_specials else torch.full_like(bos, IGNORE), targets], 1)
        return inputs, targets


class InductionBatches:
    """Randomised induction with distractors: ``SyntheticTask("induction", vocab, length, seed,
    distractors=k)``'s draws, a batch at a time; ``mixed``: the batch split evenly over those K."""

    def __init__(self, vocab: int, length: int, device, seed: int, distractors: int = 0,
                 mixed: tuple[int, ...] = ()):
        self.vocab, self.length, self.device = vocab, length, torch.device(device)
        self.ks = tuple(mixed) or (distractors,)
        slots = (length - 4) // 2
        if vocab < 4 or length < 6 or max(self.ks) > slots - 1:
            raise ValueError(f"induction: {max(self.ks)} distractor pairs need length >= {2 * max(self.ks) + 6} and "
                             f"vocab >= 4, got {length}, {vocab}")
        self.g = _generator(self.device, seed)

    def _draw(self, B: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, content, dev, g = self.length, self.vocab - 1, self.device, self.g

        def ints(high, shape):
            return torch.randint(0, high, shape, generator=g, device=dev)
        a = ints(content, (B,))
        b = (a + 1 + ints(content - 1, (B,))) % content                       # b != a
        seq = (a[:, None] + 1 + ints(content - 1, (B, T))) % content         # filler != a
        slots = (T - 2) // 2
        first = ints(max(1, min(slots // 2, slots - k)), (B, 1))              # the true pair in the first half
        seq.scatter_(1, 2 * first, a[:, None])
        seq.scatter_(1, 2 * first + 1, b[:, None])
        if k:
            # k distinct later slots: the k smallest of uniform keys over the slots after ``first``
            keys = torch.rand(B, slots, generator=g, device=dev)
            keys = keys.masked_fill(torch.arange(slots, device=dev) <= first, 2.0)
            later = keys.topk(k, dim=1, largest=False).indices
            d = (b[:, None] + 1 + ints(content - 1, (B, k))) % content         # d != b, moved off a as numpy does
            d1, d2 = (d + 1) % content, (d + 2) % content
            d = torch.where(d == a[:, None], torch.where(d1 != b[:, None], d1, d2), d)
            seq.scatter_(1, 2 * later, a[:, None].expand(B, k))
            seq.scatter_(1, 2 * later + 1, d)
        seq[:, T - 2], seq[:, T - 1] = a, self.vocab - 1                      # the query A, MASK
        targets = torch.full_like(seq, IGNORE)
        targets[:, T - 1] = b
        return seq, targets

    def examples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        B, n = len(indices), len(self.ks)
        parts = [self._draw(B // n + (i < B % n), k) for i, k in enumerate(self.ks)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
