"""The GPU kernels against fpscale's PyTorch paths, on the device (skipped without CUDA, and each
kernel's test without its package): mamba-ssm's ``selective_scan_fn`` and fpscale's Triton scan
(fpscale.ops.scan_triton, float32 and bf16, with an initial state) against the chunked scan,
flash-attn inside FPSA's fixed-point map and the looped core against SDPA, forward and backward.
On CPU the dispatch is tested with stand-in kernels (test_scan_kernels.py, test_flash_attn.py);
these are the checks a machine with a GPU runs:

    python -m pytest tests/ops/test_kernels_on_device.py -v
"""
import pytest
import torch
import torch.nn.functional as F

from fpscale.ops import attention, kernels, scan_kernels, scan_triton
from fpscale.ops.scan import selective_scan
from tests.models.helpers import tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def needs(kernel, error, package: str) -> None:
    if error is not None:
        raise error                       # installed but broken: a failure, not a skip
    if kernel is None:
        pytest.skip(f"{package} is not installed")


@cuda
@pytest.mark.parametrize("T", [64, 333])
def test_mamba_ssm_scan_matches_the_pytorch_scan(T, monkeypatch):
    needs(scan_kernels.MAMBA_SCAN, scan_kernels.MAMBA_SCAN_ERROR, "mamba-ssm")
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "0")          # mamba-ssm off is then the PyTorch scan
    g = torch.Generator(device="cuda").manual_seed(0)
    B, c, n = 2, 96, 16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    leaves = [rand(B, T, c), F.softplus(rand(B, T, c) - 2), -torch.exp(0.5 * rand(c, n)), rand(B, T, n), rand(B, T, n)]
    leaves = [t.requires_grad_() for t in leaves]
    weight = rand(B, T, c)
    results = {}
    for mode in ("1", "0"):                 # the kernel, then the PyTorch scan
        monkeypatch.setenv("FPSCALE_MAMBA_SCAN", mode)
        y, last = scan_kernels.scan(*leaves)
        results[mode] = (y, last, torch.autograd.grad((y * weight).sum(), leaves))
    (y, last, grads), (y_ref, last_ref, grads_ref) = results["1"], results["0"]
    assert rel_err(y, y_ref) < 1e-4 and rel_err(last, last_ref) < 1e-4
    for name, a, b in zip(("x", "dt", "A", "B", "C"), grads, grads_ref):
        assert rel_err(a, b) < 1e-3, name
    # and the PyTorch scan on the device is the one the CPU tests hold to the float64 reference
    y_cpu, _ = selective_scan(*(t.detach().double().cpu() for t in leaves))
    assert rel_err(y_ref.cpu(), y_cpu) < 1e-5


@cuda
@pytest.mark.parametrize("T", [64, 333])
@pytest.mark.parametrize("with_h0", [False, True])
def test_triton_scan_matches_the_pytorch_scan(T, with_h0, monkeypatch):
    """fpscale's Triton scan (FPSCALE_TRITON_SCAN=1, mamba-ssm off) against the PyTorch scan on the
    device: values, the last state, the gradients of every input (h0's too); T 333 is not a
    multiple of the 64-step checkpoint chunk. The kernels counter says which scan ran."""
    needs(scan_kernels.TRITON_SCAN, scan_kernels.TRITON_SCAN_ERROR, "triton")
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "0")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, c, n = 2, 96, 16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    leaves = [rand(B, T, c), F.softplus(rand(B, T, c) - 2), -torch.exp(0.5 * rand(c, n)), rand(B, T, n), rand(B, T, n),
              rand(B, c, n)]
    leaves = [t.requires_grad_() for t in leaves]
    args = leaves if with_h0 else leaves[:5]
    weight = rand(B, T, c)
    results = {}
    for mode, kernel in (("1", "triton"), ("0", "pytorch")):
        monkeypatch.setenv("FPSCALE_TRITON_SCAN", mode)
        kernels.reset()
        y, last = scan_kernels.scan(*args)
        assert kernels.used()["scan"] == {kernel: 1}
        results[mode] = (y, last, torch.autograd.grad((y * weight).sum(), args))
    (y, last, grads), (y_ref, last_ref, grads_ref) = results["1"], results["0"]
    assert rel_err(y, y_ref) < 1e-5 and rel_err(last, last_ref) < 1e-5
    for name, a, b in zip(("x", "dt", "A", "B", "C", "h0"), grads, grads_ref):
        assert rel_err(a, b) < 1e-4, name


@cuda
def test_triton_scan_in_bf16_keeps_a_float32_state(monkeypatch):
    """bf16 inputs: bf16 outputs and gradients within bf16's rounding of the float32 PyTorch scan on
    the same (bf16-rounded) inputs."""
    needs(scan_kernels.TRITON_SCAN, scan_kernels.TRITON_SCAN_ERROR, "triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    B, T, c, n = 2, 333, 96, 16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    leaves = [rand(B, T, c), F.softplus(rand(B, T, c) - 2), -torch.exp(0.5 * rand(c, n)), rand(B, T, n), rand(B, T, n)]
    leaves = [t.bfloat16().requires_grad_() for t in leaves]
    wide = [t.detach().float().requires_grad_() for t in leaves]
    weight = rand(B, T, c).bfloat16()
    y, last = scan_triton.triton_selective_scan(*leaves)
    y_ref, last_ref = selective_scan(*wide)
    assert y.dtype == last.dtype == torch.bfloat16
    assert rel_err(y, y_ref) < 1e-2 and rel_err(last, last_ref) < 1e-2
    grads = torch.autograd.grad((y.float() * weight.float()).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * weight.float()).sum(), wide)
    for name, a, b in zip(("x", "dt", "A", "B", "C"), grads, grads_ref):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) < 2e-2, name


@cuda
@pytest.mark.parametrize("layer_type", ["fpsa", "looped", "attn"])
def test_flash_attn_inside_a_layer_matches_sdpa_in_bf16(layer_type, monkeypatch):
    """The same iterations with flash-attn and with SDPA (4, tol 0, unrolled backward, so no
    adjoint whose length could differ): outputs and parameter gradients agree to bf16's
    resolution, and flash-attn did run in every iteration."""
    needs(attention.FLASH_ATTN, attention.FLASH_ATTN_ERROR, "flash-attn")
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flash(*args, **kwargs)

    flash = attention.FLASH_ATTN
    monkeypatch.setattr(attention, "FLASH_ATTN", counted)
    x = torch.randn(2, 128, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    solver = {"tol": 0.0, "patience": 0, "max_iter": 4, "eval_max_iter": 4, "backward": "unroll"}
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FPSCALE_FLASH_ATTN", mode)
        model = tiny_model(layer_type, d=64, solver=solver, dtype=torch.bfloat16).cuda()
        block = model.layers[0]
        out = block(x.bfloat16())
        out.float().pow(2).mean().backward()
        iterations = [st.iterations for st in model.solver_stats().values()]
        assert iterations == ([] if layer_type == "attn" else [4])
        results[mode] = (out, {k: p.grad for k, p in block.named_parameters() if p.grad is not None})
        if mode == "1":
            assert len(calls) >= max(iterations, default=1), calls
    (out, grads), (out_ref, grads_ref) = results["1"], results["0"]
    assert rel_err(out, out_ref) < 2e-2
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert rel_err(grads[name], grads_ref[name]) < 5e-2, name
