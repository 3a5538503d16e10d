"""Learning-rate schedules (linear warm-up, then ``cosine`` to min_lr, ``constant``, or ``wsd``) and
Muon's momentum warm-up.

WSD, warm-up / stable / decay (MiniCPM, Hu et al. 2024; Hägele et al. 2024, "Scaling Laws and
Compute-Optimal Training Beyond Fixed Training Durations", whose 1-sqrt cooldown is the ``1-sqrt``
shape): ``lr`` until the last ``decay_fraction`` of ``total`` steps, then down to ``min_lr`` at
``total``, linearly or as 1 - sqrt(progress).
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, schedule: str = "cosine",
          decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        decay = max(1, round(decay_fraction * total))
        start = total - decay
        if step < start:
            return lr
        progress = min(1.0, (step - start) / decay)
        factor = 1 - progress if decay_shape == "linear" else 1 - math.sqrt(progress)
        return min_lr + (lr - min_lr) * factor
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def momentum_at(step: int, momentum: float, start: float, warmup: int) -> float:
    """Muon's momentum at ``step``: from ``start`` to ``momentum`` linearly over ``warmup`` steps
    (modded-nanogpt: frac = min(step / 300, 1), (1 - frac) 0.85 + frac 0.95; Attractor the same)."""
    if warmup <= 0:
        return momentum
    frac = min(step / warmup, 1.0)
    return start + frac * (momentum - start)
