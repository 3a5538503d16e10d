"""torch's AdamW with a step that can be skipped: the trainer skips an update whose global
gradient norm is not finite (the norm is the same number on every rank, so every rank skips).

On CUDA it is torch's fused AdamW (one kernel over every parameter instead of a loop of small ones per
tensor; ``fused_by_default``), and the skip is decided on the device: the trainer hands the optimizer the
flag ``found_inf`` (a tensor: 1 where the norm is not finite) and the fused kernel leaves parameters,
moments and step counts untouched, as it does for torch's GradScaler; no host read. Elsewhere (CPU: the
loop of per-tensor ops) the trainer reads the norm and sets ``skip_next``.

DeepSpeed's ZeRO 1/2/3 optimizers skip such a step themselves (their norm is global too and
they report it as inf); this covers one process and ZeRO-0, where the engine steps directly. Under
DeepSpeed the fused AdamW is the client optimizer: ZeRO steps it on its flat fp32 partitions.
"""
from __future__ import annotations

import torch


def fused_by_default(params: list) -> bool:
    """torch's fused AdamW for parameters on CUDA (it runs on CPU too, but there the trainer keeps the
    loop every CPU figure and test was made with)."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(p.is_cuda for p in tensors)


class AdamW(torch.optim.AdamW):
    def __init__(self, params, *args, fused: bool | None = None, **kwargs):
        params = list(params)
        fused = fused_by_default(params) if fused is None else fused
        super().__init__(params, *args, fused=fused or None, **kwargs)
        self.skip_next = False
        self.skips_on_device = fused          # the trainer sets found_inf instead of reading the norm

    @torch.no_grad()
    def step(self, closure=None):
        if self.skip_next:
            self.skip_next = False
            return None
        return super().step(closure)
