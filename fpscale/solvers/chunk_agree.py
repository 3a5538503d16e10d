"""What a chunk (fpscale.solvers.chunked) agrees with the other ranks, once per chunk instead of once per
iteration as the eager loop does.

DP (``solver.forward.agree: dp``): the eager loop sums the decision's counts [unconverged, movable, non-finite]
over the DP group every iteration. A rank's own evolution (iterate, damping, patience, freezing) never
reads the sums: only *when* the solve stops does. So a chunk runs with the stop off except the cap
(``defer``), records each iteration's local counts as a [K, 3] tensor, and after the chunk one SUM
all-reduce of that tensor gives every iteration's global counts. ``first_stop`` applies the eager rule
to them on the device (min_iter, the quantile limit floor(p * B * dp), stalled, non-finite) and finds
the first iteration k* that stops; the chunk's one host read brings [stopped, k*, reason]. If k* falls
before the chunk's last iteration, or is a non-finite one (the eager loop does not apply the update
there), the chunk is run again from its saved start state with the cap at k* (and the update at k*
held where it was non-finite): the same graph, so the same iterates, and the state is the eager
loop's at k*. Cost: one saved start state (references, no copy) and, once per solve, the replay's K
applications of f beside the up to K - 1 past the stop that every chunked solve makes. The counts are
recorded only in a deferring chunk (``defer`` is a Python bool): a chunk without DP has none of it.

TP (``consensus``): the eager loop takes the MAX of every rank's stop flags every iteration. The flags
are a function of the residuals, which every TP rank computes from the same numbers: z is replicated
and f ends in an all-reduce (attn-style heads: fpsa, looped), or z is split and the norms go through
``state_reduce`` (fpmamba, fpmamba2), an all-reduce whose result is the same on every rank. So the
MAX of identical flags is the flags: a chunk acts on its own flags and checks once per chunk that the
ranks saw the same ones: each iteration's flags packed as bits (``pack_flags``: two bits per unit per
iteration, 31 iterations per int64 word), and one MAX all-reduce of [x, -x] (``differs``) tells
whether any rank's words differ. If they do (a collective whose result is not the same on every rank,
a non-deterministic f), the solve raises an error naming ``solver.execution.chunk`` rather than let the ranks
go apart (tests/parallel/run_tp_model.py runs every looped type chunked under TP2 and never sees it;
fpsa with ``halting: head`` did, which is how the exception below was found). Except where the ranks
hold different entries of one unit: fpsa with ``halting: head`` keeps each head's (token, head) entries
on the rank that holds the head, with no ``state_reduce``; a token's (or, in the adjoint, a sample's)
residual is the max over its entries, so each rank sees its own heads'
and only the MAX over the group is the token's. The layer marks its consensus ``EveryIteration``
(``FixedPointLayer.entries_split``) and the chunk applies it every iteration inside the chunk, as the
eager loop does (one small all-reduce per iteration, traced into the compiled chunk like f's own).
``state_reduce`` stays per iteration: it completes the norms themselves, and f's own collectives are
in the step; both are in the traced chunk (dynamo traces ``dist.all_reduce`` as a functional
collective, gloo included).
"""
from __future__ import annotations

import torch

from fpscale.solvers.step import CONVERGED, ETA_MIN, NONFINITE, QUANTILE


class EveryIteration:
    """A TP consensus that a chunk applies every iteration (the ranks' flags differ by design)."""
    every_iteration = True

    def __init__(self, consensus):
        self.consensus = consensus

    def __call__(self, flags: torch.Tensor) -> torch.Tensor:
        return self.consensus(flags)


BITS = 31           # iterations per int64 word (two flag bits each, the sign bit unused)


def words_for(K: int) -> int:
    return -(-K // BITS)


def pack_flags(words: list, nonfinite_words: list, flags, i: int, active: torch.Tensor) -> None:
    """Add iteration ``i``'s flags (a StopFlags of this rank) to the chunk's words, in place of the lists'
    entries: bit 2 (i mod 31) unconverged, the next bit no progress; non-finite at bit i mod 31."""
    w, shift = divmod(i, BITS)
    bits = (flags.unconverged.long() << (2 * shift)) | (flags.no_progress.long() << (2 * shift + 1))
    words[w] = words[w] | torch.where(active, bits, 0)
    nonfinite_words[w] = nonfinite_words[w] | torch.where(active & flags.nonfinite, 1 << shift, 0)


def differs(consensus, words: torch.Tensor) -> torch.Tensor:
    """One MAX all-reduce over the TP group: a device bool, True where some rank's words differ."""
    seen = consensus(torch.cat([words, -words]))
    n = words.numel()
    return (seen[:n] != -seen[n:]).any()


def first_stop(totals: torch.Tensor, k0: int, cap: torch.Tensor, min_iter: torch.Tensor,
               limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager rule on a chunk's summed counts [K, 3] (iterations k0 + 1 .. k0 + K): whether some
    iteration stops, the first that does (k*), and its reason (fpscale.solvers.stats.STOP_REASONS)."""
    K = totals.shape[0]
    ks = torch.arange(k0 + 1, k0 + K + 1, device=totals.device)
    unconverged, movable, bad = totals.unbind(1)
    bad = bad > 0
    met = unconverged <= limit
    stop = (ks <= cap) & (bad | ((ks >= min_iter) & (met | (movable == 0))))
    first = stop.long().argmax()                  # the first True (0 when none: masked by ``stopped``)
    code = torch.where(bad, NONFINITE, torch.where(unconverged == 0, CONVERGED, torch.where(met, QUANTILE, ETA_MIN)))
    return stop.any(), ks[first], code[first]
