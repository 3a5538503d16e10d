"""Randomised iteration caps: a pure function of (seed, step, layer), within [1, max_iter]."""
import numpy as np
import pytest
import torch

from fpscale.models.caps import draw_cap
from fpscale.models.config import IterationCap
from tests.models.helpers import tiny_model


@pytest.mark.parametrize("dist", ["gamma", "exponential", "lognormal_poisson"])
def test_caps_are_deterministic_bounded_and_have_the_requested_mean(dist):
    cap = IterationCap(dist=dist, mean=6.0)
    draws = [draw_cap(cap, 40, seed=3, step=s, layer=1) for s in range(4000)]
    assert draws == [draw_cap(cap, 40, seed=3, step=s, layer=1) for s in range(4000)]   # every rank agrees
    assert min(draws) >= 1 and max(draws) <= 40
    assert np.mean(draws) == pytest.approx(6.0, rel=0.1)
    assert draws != [draw_cap(cap, 40, seed=3, step=s, layer=2) for s in range(4000)]   # layers differ
    assert draw_cap(IterationCap(dist="none"), 40, 3, 0, 0) is None


def test_training_uses_the_step_cap_and_evaluation_ignores_it():
    model = tiny_model("looped", solver={"tol": 0.0, "max_iter": 30})
    model.cfg.iteration_cap = IterationCap(dist="exponential", mean=4.0)
    (layer,) = model.fixed_point_layers().values()
    tokens = torch.randint(0, 32, (2, 8))
    for step in range(5):
        model.train()
        model.set_step(step)
        model(tokens)
        assert layer.last_stats.iterations == layer.cap == draw_cap(model.cfg.iteration_cap, 30, model.seed, step, 0)
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert layer.last_stats.iterations == 30
