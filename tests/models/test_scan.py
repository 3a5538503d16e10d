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
