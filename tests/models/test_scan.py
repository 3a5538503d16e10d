import pytest
import torch

from fpscale.models.scan import chunked_scan, sequential_scan


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 16), (37, 8), (64, 64)])
def test_chunked_scan_matches_sequential(T, chunk):
    g = torch.Generator().manual_seed(T)
    a = torch.rand(2, T, 3, 5, generator=g, dtype=torch.float64)
    b = torch.randn(2, T, 3, 5, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    for init in (None, h0):
        assert torch.allclose(chunked_scan(a, b, init, chunk), sequential_scan(a, b, init), atol=1e-12)


def test_chunked_scan_is_stable_for_strong_decay():
    a = torch.full((1, 256, 4), 1e-30)     # a cumulative-product formulation would divide by ~0
    b = torch.ones(1, 256, 4)
    assert torch.allclose(chunked_scan(a, b, None, 64), torch.ones(1, 256, 4))


def test_scan_backward_matches_autograd_through_the_sequential_reference():
    from fpscale.models.scan import scan
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 19, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(2, 19, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(2, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(2, 19, 3, 4, generator=g, dtype=torch.float64)
    for init in (None, h0):
        got = torch.autograd.grad((scan(a, b, init, chunk=4) * w).sum(), [a, b] + ([h0] if init is not None else []))
        want = torch.autograd.grad((sequential_scan(a, b, init) * w).sum(), [a, b] + ([h0] if init is not None else []))
        for x, y in zip(got, want):
            assert torch.allclose(x, y, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, h: scan(a, b, h, chunk=8), (a, b, h0))
