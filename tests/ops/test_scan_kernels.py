"""The GPU kernels' dispatch, checked on CPU with stand-in modules and tensors that say they are on
CUDA: the selective scan's order (mamba-ssm, fpscale's Triton scan, the PyTorch scan with one
warning), its switches and the kernels counter; an installed but broken package is an error naming
the switch; flash-attn with FPSA's per-head temperature folded into q. The Triton kernels
themselves: test_scan_triton.py."""
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fpscale.ops import attention, kernels, scan_kernels
from fpscale.ops.scan import reference_selective_scan, selective_scan

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
    want = attention.causal_attention(q, k, v, scale)
    monkeypatch.setattr(attention, "flash_attn_for", lambda q: fake_flash)
    assert torch.allclose(attention.causal_attention(q, k, v, scale), want, atol=1e-6)


class OnGPU(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the dispatch's view of a GPU input (ops keep the class)."""

    @property
    def is_cuda(self):
        return True


def scan_inputs(T=9, c=4, n=3, h0=False):
    g = torch.Generator().manual_seed(1)
    x, dt = torch.randn(2, T, c, generator=g), torch.rand(2, T, c, generator=g)
    A, B, C = -torch.rand(c, n, generator=g), torch.randn(2, T, n, generator=g), torch.randn(2, T, n, generator=g)
    leaves = [t.as_subclass(OnGPU) for t in (x, dt, A, B, C)]
    return leaves + [torch.randn(2, c, n, generator=g).as_subclass(OnGPU) if h0 else None]


def fake_triton_scan(x, dt, A, B, C, h0=None):
    return reference_selective_scan(x, dt, A, B, C, h0)


@pytest.fixture
def dispatch(monkeypatch):
    """Stand-in kernels: mamba-ssm and the Triton scan installed; the warnings said, reset per test."""
    for env in ("FPSCALE_MAMBA_SCAN", "FPSCALE_TRITON_SCAN"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", fake_selective_scan_fn)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", None)
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN", fake_triton_scan)
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN_ERROR", None)
    monkeypatch.setattr(scan_kernels, "TRITON_INTERPRET", False)
    monkeypatch.setattr(scan_kernels, "_warned", False)
    said = []
    monkeypatch.setattr(scan_kernels.log, "warning", lambda msg, *args: said.append(msg % args))
    kernels.reset()
    return said


def ran():
    return kernels.used().get("scan", {})


def test_the_dispatch_order_on_a_gpu(dispatch, monkeypatch):
    """mamba-ssm for a full sequence; the Triton scan for a carried state or without mamba-ssm;
    PyTorch without either, with one warning per process. Each result is the scan's."""
    x, dt, A, B, C, _ = scan_inputs()
    h0 = scan_inputs(h0=True)[5]
    y_ref, last_ref = selective_scan(x, dt, A, B, C)
    y, last = scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"mamba-ssm": 1}
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(last, last_ref, atol=1e-5)
    y, last = scan_kernels.scan(x, dt, A, B, C, h0)
    assert ran() == {"mamba-ssm": 1, "triton": 1}
    assert torch.allclose(y, selective_scan(x, dt, A, B, C, h0)[0], atol=1e-5)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"mamba-ssm": 1, "triton": 2}
    assert dispatch == []
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN", None)
    for _ in range(3):
        y, last = scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"mamba-ssm": 1, "triton": 2, "pytorch": 3}
    assert torch.allclose(y, y_ref) and torch.allclose(last, last_ref)
    assert len(dispatch) == 1, dispatch                                 # once per process
    assert ("runs on its PyTorch fallback on this GPU (triton is not installed): about 400 kernel launches per "
            "scan call at T = 2048" in dispatch[0])
    assert "tens of times slower" in dispatch[0] and "install triton" in dispatch[0] and "mamba-ssm" in dispatch[0]


def test_on_cpu_the_pytorch_scan_runs_quietly(dispatch):
    x, dt, A, B, C = (t.as_subclass(torch.Tensor) for t in scan_inputs()[:5])
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"pytorch": 1} and dispatch == []


def test_the_triton_switch(dispatch, monkeypatch):
    x, dt, A, B, C, _ = scan_inputs()
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "0")
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"pytorch": 1}
    assert len(dispatch) == 1 and "(FPSCALE_TRITON_SCAN=0)" in dispatch[0]
    assert "unset FPSCALE_TRITON_SCAN" in dispatch[0]
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "1")
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"pytorch": 1, "triton": 1}
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN", None)
    with pytest.raises(RuntimeError, match="fpscale's Triton scan is wanted on this GPU but it is not installed"
                                           ".*pip install triton.*FPSCALE_TRITON_SCAN=0 to run FP-Mamba's scan in "
                                           "PyTorch"):
        scan_kernels.scan(x, dt, A, B, C)
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "auto")
    scan_kernels.scan(x, dt, A, B, C)                       # auto: absent is the PyTorch scan
    assert ran() == {"pytorch": 2, "triton": 1} and len(dispatch) == 1
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "on")
    with pytest.raises(ValueError, match="FPSCALE_TRITON_SCAN must be auto, 0 or 1, got 'on'"):
        scan_kernels.scan(x, dt, A, B, C)


def test_the_mamba_switch_hands_over_to_the_triton_scan(dispatch, monkeypatch):
    x, dt, A, B, C, _ = scan_inputs()
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "0")
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"triton": 1}
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "1")
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"triton": 1, "mamba-ssm": 1}


def test_a_broken_install_names_the_switch_and_what_runs_instead(dispatch, monkeypatch):
    x, dt, A, B, C, _ = scan_inputs()
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", OSError("selective_scan_cuda.so: undefined symbol"))
    with pytest.raises(RuntimeError, match="undefined symbol.*set FPSCALE_MAMBA_SCAN=0 to run fpscale's Triton scan "
                                           "instead"):
        scan_kernels.scan(x, dt, A, B, C)
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN", None)
    with pytest.raises(RuntimeError, match="FPSCALE_MAMBA_SCAN=0 to run FP-Mamba's scan in PyTorch"):
        scan_kernels.scan(x, dt, A, B, C)
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "0")
    monkeypatch.setattr(scan_kernels, "TRITON_SCAN_ERROR", ImportError("libcuda.so.1: cannot open shared object"))
    with pytest.raises(RuntimeError, match="fpscale's Triton scan is wanted on this GPU but it fails to import: "
                                           "ImportError.*libcuda.*FPSCALE_TRITON_SCAN=0"):
        scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {}


def test_what_the_triton_scan_cannot_take_runs_in_pytorch_with_the_reason(dispatch, monkeypatch):
    x, dt, A, B, C = (t.double() for t in scan_inputs()[:5])
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    scan_kernels.scan(x, dt, A, B, C)
    assert ran() == {"pytorch": 1}
    assert len(dispatch) == 1 and "(float64 inputs, d_state 3)" in dispatch[0]


def test_the_interpreter_serves_cpu_tensors_only_when_asked(dispatch, monkeypatch):
    x, dt, A, B, C = (t.as_subclass(torch.Tensor) for t in scan_inputs()[:5])
    monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", None)
    monkeypatch.setattr(scan_kernels, "TRITON_INTERPRET", True)
    scan_kernels.scan(x, dt, A, B, C)
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "1")
    scan_kernels.scan(x, dt, A, B, C)
    monkeypatch.setattr(scan_kernels, "TRITON_INTERPRET", False)
    scan_kernels.scan(x, dt, A, B, C)              # compiled kernels: CPU tensors stay in PyTorch
    assert ran() == {"pytorch": 2, "triton": 1} and dispatch == []
