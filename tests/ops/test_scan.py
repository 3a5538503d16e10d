"""The chunked selective scan against the step-by-step reference, in float64, forward and backward."""
import pytest
import torch

from fpscale.ops.scan import reference_selective_scan, selective_scan, sequential_scan


def inputs(T, c=3, n=5, batch=2, seed=0, strong=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, c, generator=g, dtype=torch.float64)
    dt = torch.rand(batch, T, c, generator=g, dtype=torch.float64) * (30.0 if strong else 0.5)
    A = -torch.rand(c, n, generator=g, dtype=torch.float64) * (30.0 if strong else 2.0)
    B, C = (torch.randn(batch, T, n, generator=g, dtype=torch.float64) for _ in range(2))
    h0 = torch.randn(batch, c, n, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, h0


def test_the_scan_stays_float32_under_bf16_autocast():
    """Its contractions are matmuls, which bf16 autocast would run in bf16 (a 3e-3 error); the
    scan keeps float32 under the trainer's autocast, forward and backward."""
    x, dt, A, B, C, _ = (t.float() for t in inputs(40, c=16, n=8))
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C)]
    y_ref, _ = reference_selective_scan(*(t.detach().double() for t in leaves))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, last = selective_scan(*leaves, chunk=8)
        grads = torch.autograd.grad(y.sum(), leaves)
    assert y.dtype == last.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert float((y.detach().double() - y_ref).norm() / y_ref.norm()) < 1e-6
    plain = torch.autograd.grad(selective_scan(*leaves, chunk=8)[0].sum(), leaves)
    for a, b in zip(grads, plain):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_sequential_scan_is_the_recurrence():
    a, b = torch.rand(1, 3, 2, dtype=torch.float64), torch.randn(1, 3, 2, dtype=torch.float64)
    h = sequential_scan(a, b)
    assert torch.allclose(h[:, 2], a[:, 2] * (a[:, 1] * b[:, 0] + b[:, 1]) + b[:, 2])


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 16), (37, 8), (64, 64), (50, 1)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_selective_scan_matches_the_reference_forward_and_backward(T, chunk, with_h0):
    x, dt, A, B, C, h0 = inputs(T, seed=T)
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, h0)]
    init = h0 if with_h0 else None
    w = torch.randn(2, T, 3, dtype=torch.float64)
    y, last = selective_scan(x, dt, A, B, C, init, chunk=chunk)
    y_ref, last_ref = reference_selective_scan(x, dt, A, B, C, init)
    assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(last, last_ref, atol=1e-12)
    wrt = leaves if with_h0 else leaves[:5]
    got = torch.autograd.grad((y * w).sum(), wrt)
    want = torch.autograd.grad((y_ref * w).sum(), wrt)
    for name, a, b in zip("x dt A B C h0".split(), got, want):
        assert torch.allclose(a, b, atol=1e-10), name


def test_selective_scan_gradcheck():
    x, dt, A, B, C, h0 = (t.requires_grad_() for t in inputs(11, c=2, n=3))
    assert torch.autograd.gradcheck(lambda *a: selective_scan(*a, chunk=4)[0], (x, dt, A, B, C, h0))


def test_selective_scan_is_stable_for_strong_decay():
    """exp(dt A) ~ 1e-300 per step: no exponent is ever positive, so nothing overflows or divides by 0."""
    x, dt, A, B, C, h0 = inputs(64, strong=True)
    y, last = selective_scan(x.float(), dt.float(), A.float(), B.float(), C.float(), h0.float(), chunk=16)
    y_ref, last_ref = reference_selective_scan(x, dt, A, B, C, h0)
    assert torch.isfinite(y).all() and torch.allclose(y.double(), y_ref, atol=1e-4)
    assert torch.allclose(last.double(), last_ref, atol=1e-4)
    leaves = [t.float().requires_grad_() for t in (x, dt, A, B, C, h0)]
    grads = torch.autograd.grad(selective_scan(*leaves, chunk=16)[0].sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


def test_carrying_the_state_splits_the_scan_exactly():
    """The decode path: a prefix's last state as the initial state of the rest is the whole scan."""
    x, dt, A, B, C, _ = inputs(23)
    y, last = selective_scan(x, dt, A, B, C, chunk=8)
    y1, h1 = selective_scan(x[:, :10], dt[:, :10], A, B[:, :10], C[:, :10], chunk=8)
    steps, h = [], h1
    for t in range(10, 23):       # one token at a time, as generation does
        yt, h = selective_scan(x[:, t:t + 1], dt[:, t:t + 1], A, B[:, t:t + 1], C[:, t:t + 1], h)
        steps.append(yt)
    assert torch.allclose(torch.cat([y1, *steps], 1), y, atol=1e-12)
    assert torch.allclose(h, last, atol=1e-12)
