"""Randomised iteration caps for training, identical on every rank.

The draw for (seed, step, layer) comes from numpy's generator seeded with exactly that
triple, so every rank, and a resumed run, draws the same cap without communicating.
"""
from __future__ import annotations

import numpy as np

from fpscale.models.config import IterationCap


def draw_cap(cap: IterationCap, max_iter: int, seed: int, step: int, layer: int) -> int | None:
    if cap.dist == "none":
        return None
    rng = np.random.default_rng([seed, step, layer])
    if cap.dist == "gamma":            # seed 002: Gamma(4, 1), rescaled to the requested mean
        value = rng.gamma(4.0, cap.mean / 4.0)
    elif cap.dist == "exponential":    # seed 004
        value = rng.exponential(cap.mean)
    else:                              # Huginn: r ~ Poisson(tau) + 1, tau ~ LogNormal
        tau = rng.lognormal(np.log(max(cap.mean - 1.0, 1e-3)) - cap.sigma ** 2 / 2, cap.sigma)
        value = rng.poisson(tau) + 1
    return int(min(max(round(float(value)), 1), max_iter))
