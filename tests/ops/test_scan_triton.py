"""fpscale's Triton scan (fpscale.ops.scan_triton) against the float64 reference, run by Triton's
interpreter on CPU: values, the last state and the gradients of x, dt, A, B, C and h0, with T not a
multiple of the checkpoint chunk (several chunks), channels not a multiple of the channel block, a
padded d_state, float32 and bfloat16 inputs, strided inputs and the dispatch.

The interpreter is chosen when the kernels are defined (``TRITON_INTERPRET=1`` before
fpscale.ops.scan_triton is first imported), and in one pytest process over the whole suite
another module may have imported it already. So the kernel tests (``test_kernel_*``) run in a child
pytest process over this file with ``TRITON_INTERPRET=1``, started by
``test_the_triton_scan_under_the_interpreter`` (and its slow twin); in the parent they are skipped
as such. The tests that need no kernel (the guarded import, the refusal on CPU, bad input) run in
the parent.

    python -m pytest tests/ops/test_scan_triton.py -q              # the child runs inside
    TRITON_INTERPRET=1 python -m pytest tests/ops/test_scan_triton.py -q -k "not interpreter"
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fpscale.ops import kernels, scan_kernels, scan_triton
from fpscale.ops.scan import reference_selective_scan, selective_scan
from tests.interpreter import run_kernel_tests_interpreted
from tests.ops.test_scan import inputs as float64_inputs

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="a kernel test: run under TRITON_INTERPRET=1 by "
                                                         "test_the_triton_scan_under_the_interpreter (child process)")


def triton_or_skip() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton): the Triton scan's kernels cannot be tested")
    if scan_triton.TRITON_SCAN_ERROR is not None:
        raise scan_triton.TRITON_SCAN_ERROR          # installed but broken: a failure, not a skip


def run_child(marker: str) -> None:
    """This file's kernel tests (``test_kernel_*``, those matching ``marker``) in a child under the
    interpreter: all of them must run and pass."""
    triton_or_skip()
    run_kernel_tests_interpreted(__file__, marker)


@pytest.mark.slow
def test_the_triton_scan_under_the_interpreter():
    run_child("not slow")


@pytest.mark.slow
def test_the_triton_scan_under_the_interpreter_slow_cases():
    run_child("slow")


def inputs(T, c=6, n=5, batch=2, seed=0, dtype=torch.float32, strong=False):
    """test_scan's float64 inputs (x, dt, A, B, C, h0) and the loss's weights g_t, rounded to ``dtype``
    once, so the float64 reference sees exactly what the kernel sees."""
    tensors = float64_inputs(T, c, n, batch, seed, strong)
    w = torch.randn(batch, T, c, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return [t.to(dtype) for t in tensors], w.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(T, dtype, with_h0, tol_y, tol_grad, chunk=8, block_c=4, **kw):
    leaves, w = inputs(T, dtype=dtype, **kw)
    leaves = [t.requires_grad_() for t in leaves]
    ref = [t.detach().double().requires_grad_() for t in leaves]
    init, init_ref = (leaves[5], ref[5]) if with_h0 else (None, None)
    y, last = scan_triton.triton_selective_scan(*leaves[:5], init, chunk=chunk, block_c=block_c)
    y_ref, last_ref = reference_selective_scan(*ref[:5], init_ref)
    assert y.dtype == last.dtype == dtype and y.shape == y_ref.shape and last.shape == last_ref.shape
    assert not last.requires_grad
    assert rel_err(y, y_ref) < tol_y and rel_err(last, last_ref) < tol_y
    wrt, wrt_ref = (leaves, ref) if with_h0 else (leaves[:5], ref[:5])
    grads = torch.autograd.grad((y * w).sum(), wrt)
    grads_ref = torch.autograd.grad((y_ref * w.double()).sum(), wrt_ref)
    for name, a, b in zip("x dt A B C h0".split(), grads, grads_ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol_grad, (name, rel_err(a, b))
    return y, last, grads


@interpreted
@pytest.mark.parametrize("with_h0", [True, False])
def test_kernel_float32_matches_the_float64_reference(with_h0):
    """T 21 = 2 chunks of 8 and a tail of 5; 6 channels in blocks of 4 (the second half masked);
    d_state 5 padded to 8."""
    compare(21, torch.float32, with_h0, 1e-6, 1e-5)


@interpreted
def test_kernel_bfloat16_inputs_keep_a_float32_state():
    """bf16 in and out (as the PyTorch scan), the state and every sum in float32: the outputs and
    gradients are the reference's up to the final rounding to bf16, where the PyTorch scan in bf16
    (a bf16 state) is several times further off."""
    y, last, _ = compare(21, torch.bfloat16, True, 8e-3, 1.5e-2)
    leaves, _ = inputs(21, dtype=torch.bfloat16)
    y_ref, _ = reference_selective_scan(*(t.double() for t in leaves))
    y_bf16_torch, _ = selective_scan(*leaves)
    assert rel_err(y, y_ref) < rel_err(y_bf16_torch, y_ref)


@interpreted
def test_kernel_autotuned_forward_tries_every_config_and_each_matches_the_reference():
    """block_c=None (the dispatch's default): triton.autotune runs every config of FWD_CONFIGS whose state
    fits the registers (under the interpreter once each) and keeps one; the result, and the forward at each
    config's block_c (40 channels: blocks of 16 and 32 end masked), match the float64 reference."""
    tuned = scan_triton._scan_fwd_tuned
    compare(21, torch.float32, True, 1e-6, 1e-5, block_c=None, c=40)
    assert {cf.kwargs["BLOCK_C"] for cf in tuned.configs_timings} == {bc for bc, _ in scan_triton.FWD_CONFIGS}
    assert tuned.best_config.kwargs["BLOCK_C"] in {bc for bc, _ in scan_triton.FWD_CONFIGS}
    for block_c, _ in scan_triton.FWD_CONFIGS:
        compare(21, torch.float32, False, 1e-6, 1e-5, block_c=block_c, c=40)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("T,chunk,block_c,dtype,with_h0", [(70, 16, 8, torch.float32, False),
                                                           (37, 64, 8, torch.bfloat16, False),
                                                           (1, 8, 4, torch.float32, True)])
def test_kernel_more_shapes_match_the_reference(T, chunk, block_c, dtype, with_h0):
    tol = (1e-6, 1e-5) if dtype == torch.float32 else (8e-3, 1.5e-2)
    compare(T, dtype, with_h0, *tol, chunk=chunk, block_c=block_c, c=5, n=3)


@interpreted
@pytest.mark.slow
def test_kernel_strong_decay_stays_finite_and_exact():
    """exp(dt A) down to ~1e-300 per step: every exponent is <= 0, nothing overflows."""
    compare(19, torch.float32, True, 1e-5, 1e-4, strong=True)


@interpreted
def test_kernel_strided_inputs_no_grad_and_decoding():
    """B and C as slices of one projection, x transposed from [B, c, T]: read in place, the same
    result as contiguous copies. Without grad no checkpoint is written, and the decode path (the
    last state carried one token at a time) continues the full scan exactly."""
    (x, dt, A, B, C, h0), _ = inputs(11)
    proj = torch.cat([B, C, torch.zeros_like(B)], -1)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    y, last = scan_triton.triton_selective_scan(xt, dt, A, proj[..., :5], proj[..., 5:10], h0, chunk=4, block_c=4)
    y2, last2 = scan_triton.triton_selective_scan(x, dt, A, B, C, h0, chunk=4, block_c=4)
    assert torch.equal(y, y2) and torch.equal(last, last2)
    with torch.no_grad():
        y_prefix, h = scan_triton.triton_selective_scan(x[:, :8], dt[:, :8], A, B[:, :8], C[:, :8], h0)
        steps = [y_prefix]
        for t in range(8, 11):
            y_t, h = scan_triton.triton_selective_scan(x[:, t:t + 1], dt[:, t:t + 1], A, B[:, t:t + 1],
                                                       C[:, t:t + 1], h)
            steps.append(y_t)
    assert torch.allclose(torch.cat(steps, 1), y, atol=1e-5) and torch.allclose(h, last, atol=1e-5)


@interpreted
def test_kernel_checkpoints_only_where_a_gradient_can_follow(monkeypatch):
    """The forward writes its checkpoints only when grad mode is on and an input requires grad
    (decoding under no_grad with a parameter-derived A writes none)."""
    saves = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                saves.append(kwargs["SAVE"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_scan_fwd", "_scan_fwd_tuned"):        # a fixed block_c, and the autotuned default
        monkeypatch.setattr(scan_triton, name, Spy(getattr(scan_triton, name)))
    (x, dt, A, B, C, _), _ = inputs(3, c=4, n=2, batch=1)
    A.requires_grad_()
    with torch.no_grad():
        scan_triton.triton_selective_scan(x, dt, A, B, C)
    scan_triton.triton_selective_scan(x, dt, A.detach(), B, C)
    scan_triton.triton_selective_scan(x, dt, A, B, C)
    assert saves == [False, False, True]


@interpreted
def test_kernel_dispatch_reaches_the_triton_scan_under_the_interpreter(monkeypatch):
    """FPSCALE_TRITON_SCAN=1 sends CPU tensors to the interpreted kernels; auto keeps PyTorch on CPU."""
    assert scan_triton.INTERPRET and scan_kernels.TRITON_INTERPRET and scan_kernels.TRITON_SCAN is not None
    (x, dt, A, B, C, h0), _ = inputs(5)
    kernels.reset()
    y_auto, _ = scan_kernels.scan(x, dt, A, B, C, h0)
    monkeypatch.setenv("FPSCALE_TRITON_SCAN", "1")
    y, _ = scan_kernels.scan(x, dt, A, B, C, h0)
    assert kernels.used()["scan"] == {"pytorch": 1, "triton": 1}
    assert torch.allclose(y, y_auto, atol=1e-5)


def test_the_triton_scan_refuses_cpu_tensors_without_the_interpreter():
    if INTERPRETED:
        pytest.skip("the parent's check: this process runs the interpreter")
    (x, dt, A, B, C, _), _ = inputs(3)
    why = "TRITON_INTERPRET=1" if scan_triton.AVAILABLE else "triton"
    with pytest.raises(RuntimeError, match=f"Triton scan cannot run here.*{why}"):
        scan_triton.triton_selective_scan(x, dt, A, B, C)


def test_bad_input_is_a_clear_error():
    (x, dt, A, B, C, h0), _ = inputs(4)
    check = scan_triton.check_inputs
    with pytest.raises(ValueError, match="x and dt must be"):
        check(x, dt[:, :3], A, B, C, None)
    with pytest.raises(ValueError, match=r"A must be \[c, n\] with c = 6"):
        check(x, dt, A[:4], B, C, None)
    with pytest.raises(ValueError, match=r"C must be \[B, T, n\]"):
        check(x, dt, A, B, C[..., :2], None)
    with pytest.raises(ValueError, match=r"h0 must be \[B, c, n\]"):
        check(x, dt, A, B, C, h0[:1])
    with pytest.raises(ValueError, match="all of one dtype, got float32, float64"):
        check(x, dt.double(), A, B, C, None)
    with pytest.raises(ValueError, match="float64"):
        check(*(t.double() for t in (x, dt, A, B, C)), None)
    with pytest.raises(ValueError, match="non-empty"):
        check(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], None)
    with pytest.raises(ValueError, match="d_state <= 128"):
        check(x, dt, torch.zeros(6, 300), torch.zeros(2, 4, 300), torch.zeros(2, 4, 300), None)
    check(x, dt, A, B, C, h0)                              # and good input passes


@pytest.mark.slow     # a child process (imports torch: seconds): the full suite, not the quick loop
def test_it_imports_without_triton():
    """No triton: the module imports, says so, and the dispatch runs the PyTorch scan."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from fpscale.models import kernels, scan_kernels, scan_triton\n"
            "assert not scan_triton.AVAILABLE and scan_triton.TRITON_SCAN_ERROR is None\n"
            "assert scan_kernels.TRITON_SCAN is None and scan_kernels.TRITON_SCAN_ERROR is None\n"
            "x = torch.randn(1, 3, 2)\n"
            "scan_kernels.scan(x, x.abs(), -torch.ones(2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4))\n"
            "assert kernels.used() == {'scan': {'pytorch': 1}}, kernels.used()\n"
            "try:\n"
            "    scan_triton.triton_selective_scan(x, x, -torch.ones(2, 4), x, x)\n"
            "except RuntimeError as e:\n"
            "    assert 'triton is not installed' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('ran without triton')\n")
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
