"""torch's AdamW with a step that can be skipped: the trainer skips an update whose global
gradient norm is not finite (the norm is the same number on every rank, so every rank skips).

DeepSpeed's ZeRO 1/2/3 optimizers skip such a step themselves (their norm is global too and
they report it as inf); this covers one process and ZeRO-0, where the engine steps directly.
"""
from __future__ import annotations

import torch


class AdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip_next = False

    @torch.no_grad()
    def step(self, closure=None):
        if self.skip_next:
            self.skip_next = False
            return None
        return super().step(closure)
