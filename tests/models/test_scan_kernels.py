"""The GPU kernels' dispatch, checked on CPU with stand-in modules: mamba-ssm's selective scan
(absent: the PyTorch scan in silence; installed but broken: an error naming the switch) and
flash-attn with FPSA's per-head temperature folded into q."""
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fpscale.models import common, scan_kernels
from fpscale.models.scan import reference_selective_scan, selective_scan

GPU = SimpleNamespace(is_cuda=True, dtype=torch.float32)


def test_an_absent_mamba_ssm_is_quietly_the_pytorch_scan(monkeypatch):
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    assert scan_kernels.load_mamba_scan() == (None, None)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", None)
    assert scan_kernels.mamba_scan_for(GPU, None) is None


def test_a_broken_mamba_ssm_install_is_reported_not_swallowed(tmp_path, monkeypatch):
    pkg = tmp_path / "mamba_ssm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('selective_scan_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mamba_ssm", raising=False)
    fn, error = scan_kernels.load_mamba_scan()
    assert fn is None and isinstance(error, OSError)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", error)
    with pytest.raises(RuntimeError, match=r"mamba-ssm's selective scan is wanted on this GPU but it fails to "
                                           r"import: OSError.*undefined symbol.*FPSCALE_MAMBA_SCAN=0"):
        scan_kernels.mamba_scan_for(GPU, None)
    assert scan_kernels.mamba_scan_for(GPU, torch.zeros(1)) is None          # a carried state: PyTorch
    assert scan_kernels.mamba_scan_for(SimpleNamespace(is_cuda=False), None) is None
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "0")
    assert scan_kernels.mamba_scan_for(GPU, None) is None
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "1")
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", None)
    with pytest.raises(RuntimeError, match="it is not installed"):
        scan_kernels.mamba_scan_for(GPU, None)
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "yes")
    with pytest.raises(ValueError, match="FPSCALE_MAMBA_SCAN must be auto, 0 or 1, got 'yes'"):
        scan_kernels.mamba_scan_for(GPU, None)


def fake_selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False):
    """mamba-ssm's layout: u, delta [B, c, T], B, C [B, n, T], last state [B, c, n]."""
    y, last = reference_selective_scan(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2),
                                       C.transpose(1, 2))
    return (y.transpose(1, 2), last) if return_last_state else y.transpose(1, 2)


def test_the_kernel_path_matches_the_pytorch_scan(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(2, 13, 6, generator=g, dtype=torch.float64), torch.rand(2, 13, 6, generator=g).double()
    A = -torch.rand(6, 4, generator=g, dtype=torch.float64)
    B, C = torch.randn(2, 13, 4, generator=g).double(), torch.randn(2, 13, 4, generator=g).double()
    monkeypatch.setattr(scan_kernels, "mamba_scan_for", lambda x, h0: fake_selective_scan_fn)
    y, last = scan_kernels.scan(x, dt, A, B, C)
    y_ref, last_ref = selective_scan(x, dt, A, B, C)
    assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(last, last_ref, atol=1e-12)


def test_flash_attn_serves_a_per_head_temperature(monkeypatch):
    """FPSA's per-head scale is folded into q, so its iterations run on flash-attn too."""
    def fake_flash(q, k, v, causal, softmax_scale, dropout_p):      # flash-attn's [B, T, H, dh] layout
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                             scale=softmax_scale)
        return out.transpose(1, 2)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    scale = torch.rand(4, generator=g) + 0.5
    want = common.causal_attention(q, k, v, scale)
    monkeypatch.setattr(common, "flash_attn_for", lambda q: fake_flash)
    assert torch.allclose(common.causal_attention(q, k, v, scale), want, atol=1e-6)
