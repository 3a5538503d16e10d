"""Bytes saved for backward: constant in the iteration count except for `unroll`."""
import pytest
import torch

from fpscale.profiling import count_saved_bytes
from fpscale.solvers import SolverConfig, solve


def saved_bytes(fn) -> int:
    with count_saved_bytes() as counter:
        out = fn()
    out.sum().backward()
    return counter.total


def make_case():
    torch.manual_seed(0)
    W = torch.nn.Parameter(0.3 * torch.randn(32, 32) / 32 ** 0.5)
    x = torch.randn(4, 16, 32)
    return W, x, (lambda z: torch.tanh(z @ W + x))


@pytest.mark.parametrize("mode", ["implicit", "phantom", "jfb"])
def test_saved_bytes_constant_in_iterations(mode):
    W, x, f = make_case()
    counts = {n: saved_bytes(lambda: solve(f, torch.zeros_like(x), SolverConfig(
        max_iter=n, tol=0.0, patience=0, backward=mode, mask_unconverged=False), training=True)[0])
        for n in (8, 64)}
    assert counts[8] == counts[64] > 0
    one = saved_bytes(lambda: f(torch.zeros_like(x)))
    steps = {"implicit": 1, "jfb": 1, "phantom": SolverConfig().phantom_steps}[mode]
    assert counts[8] <= steps * one + 8 * x.numel()   # f's own activations, plus at most a mask


def test_saved_bytes_grow_linearly_for_unroll():
    W, x, f = make_case()
    counts = [saved_bytes(lambda: solve(f, torch.zeros_like(x), SolverConfig(
        max_iter=n, tol=0.0, patience=0, backward="unroll"), training=True)[0]) for n in (8, 16, 64)]
    per_iter = (counts[1] - counts[0]) / 8
    assert per_iter > 0
    assert counts[2] - counts[1] == pytest.approx(48 * per_iter, rel=1e-9)
