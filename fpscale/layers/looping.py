"""What every looped layer shares, whatever decides how often it repeats its map: a fixed point
(``FixedPointLayer``: the solver stops on convergence) or a learned halting policy (``epsilon``:
each token stops when its halting distribution has spent its mass).

    shards        the seam where its tensor-parallel shards meet (fpscale.parallel swaps it)
    optim_step    the optimizer step its forwards belong to (``LoopedLM.set_step``): per-step
                  state such as a power iteration advances once per step, an annealed loss
                  weight follows the step
    eval_depth    at most this many repetitions at evaluation (``LoopedLM.eval_depth``)
    decode_cache  what its decoding cache keeps of past tokens (``decode.cache``, ``LoopedLM.decode_cache``):
                  ``exact`` every iteration's entries, ``fixed_point`` the fixed point's (a fixed-point layer;
                  epsilon keeps its per-step entries either way, docs/decoding.md)
    decode_compact  whether a decoding solve runs its map only on the rows not yet done
                  (``decode.compact``, fpscale.solvers.rows)
    last_stats    the statistics of its last forward (``to_dict()`` when a log step reads them)
    aux_loss      its auxiliary loss of the last training forward, already weighted, or None;
                  ``LoopedLM`` adds it to the cross-entropy
    backward_mode how its backward is computed, for the FLOP count (fpscale.train.flops)
"""
from __future__ import annotations

from typing import Any

import torch

from fpscale.layers.common import Unsharded


class LoopedLayer(torch.nn.Module):
    backward_mode = "unroll"        # autograd through every repetition
    phantom_steps = 1

    def __init__(self):
        super().__init__()
        self.shards = Unsharded()        # replaced by fpscale.parallel for tensor parallelism
        self.optim_step: int | None = None
        self.eval_depth: int | None = None
        self.decode_cache = "exact"
        self.decode_compact = True       # decode.compact: decoding's solves drop their done rows
        self.token_capacity = 0          # the decoding cache's preallocated tokens (LoopedLM: model.max_seq_len)
        self.last_stats: Any = None
        self.aux_loss: torch.Tensor | None = None
        self._power_step: int | None = None   # the step whose forward last advanced a power iteration

    def advance_power_step(self) -> bool:
        """Whether this forward advances the layer's power iteration (spectral norms), and if so
        records it: training forwards with grad, once per optimizer step when the trainer sets the
        step (so one process with 2 micro-batches and 2 data-parallel ranks with 1 do the same),
        else every forward."""
        new_step = self.optim_step is None or self.optim_step != self._power_step
        update = self.training and torch.is_grad_enabled() and new_step
        if update:
            self._power_step = self.optim_step
        return update
