"""Linear warm-up, then cosine decay to min_lr."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
