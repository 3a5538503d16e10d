"""Which selective scan FP-Mamba runs. On a CUDA tensor, the first that applies of
  1. mamba-ssm's ``selective_scan_fn`` (installed, and a scan without an initial state: decoding
     carries a state, which mamba-ssm does not take);
  2. fpscale's Triton scan (fpscale.ops.scan_triton: float32 / bfloat16 / float16 inputs, any
     initial state; triton comes with CUDA torch wheels);
  3. the chunked PyTorch scan (fpscale.ops.scan), with one warning per process: about 400
     kernel launches per forward at T = 2048 (about 1000 with the backward), tens of times slower
     than a fused scan.
On CPU, the PyTorch scan. Each call records what ran (``fpscale.ops.kernels``: ``scan: mamba-ssm``,
``triton`` or ``pytorch``).

Switches, each ``auto`` (default), ``0`` (never) or ``1`` (required on CUDA where it applies):
``FPSCALE_MAMBA_SCAN`` and ``FPSCALE_TRITON_SCAN``. An installed package that fails to import (a
mamba-ssm or triton built for another CUDA or torch) is an error that names the switch and what
runs with it at 0, not a silent fallback, as for flash-attn (fpscale.ops.attention.wanted_kernel).

Under Triton's interpreter (``TRITON_INTERPRET=1`` before fpscale.ops.scan_triton is first
imported) ``FPSCALE_TRITON_SCAN=1`` also sends CPU tensors to the Triton scan, so the dispatch and
the kernels can be tested without a GPU; ``auto`` never picks the (very slow) interpreter on CPU.

    python -m pytest tests/ops/test_scan_kernels.py tests/ops/test_scan_triton.py -q
"""
from __future__ import annotations

import os

import torch

from fpscale.log import get_logger
from fpscale.ops.attention import load_optional, wanted_kernel
from fpscale.ops.kernels import ran as record_kernel
from fpscale.ops.scan import selective_scan
from fpscale.ops.scan_triton import AVAILABLE, DTYPES, INTERPRET, MAX_D_STATE, triton_selective_scan
from fpscale.ops.scan_triton import TRITON_SCAN_ERROR as TRITON_IMPORT_ERROR

log = get_logger(__name__)


def load_mamba_scan():
    """(selective_scan_fn, None), or None and why not (``load_optional``)."""
    return load_optional("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn")


def load_triton_scan():
    """(triton_selective_scan, None), or None and why not: (None, None) without triton, (None, the
    exception) when triton is installed but fails to import."""
    if AVAILABLE:
        return triton_selective_scan, None
    return None, TRITON_IMPORT_ERROR


MAMBA_SCAN, MAMBA_SCAN_ERROR = load_mamba_scan()
TRITON_SCAN, TRITON_SCAN_ERROR = load_triton_scan()
TRITON_INTERPRET = INTERPRET        # the Triton scan's kernels run in the interpreter
_warned = False                                 # the PyTorch-on-GPU warning, once per process


def mamba_scan_for(x: torch.Tensor, h0: torch.Tensor | None):
    """mamba-ssm's selective_scan_fn for this input, or None for the next scan in line."""
    instead = "run fpscale's Triton scan instead" if TRITON_SCAN is not None else "run FP-Mamba's scan in PyTorch"
    return wanted_kernel("FPSCALE_MAMBA_SCAN", MAMBA_SCAN, MAMBA_SCAN_ERROR, x.is_cuda and h0 is None,
                         "mamba-ssm's selective scan", "mamba-ssm", instead)


def _triton_fits(x: torch.Tensor, A: torch.Tensor) -> bool:
    return x.dtype in DTYPES and A.shape[-1] <= MAX_D_STATE


def triton_scan_for(x: torch.Tensor, A: torch.Tensor):
    """fpscale's Triton scan for this input, or None for the PyTorch scan: on CUDA (float32, bfloat16,
    float16; d_state <= 128), and on CPU when its kernels are interpreted and FPSCALE_TRITON_SCAN=1."""
    interpreted = TRITON_INTERPRET and os.environ.get("FPSCALE_TRITON_SCAN") == "1"
    return wanted_kernel("FPSCALE_TRITON_SCAN", TRITON_SCAN, TRITON_SCAN_ERROR,
                         (x.is_cuda or interpreted) and _triton_fits(x, A), "fpscale's Triton scan", "triton",
                         "run FP-Mamba's scan in PyTorch")


def _warn_pytorch_on_gpu(x: torch.Tensor, A: torch.Tensor) -> None:
    """One loud warning per process: the PyTorch scan on a GPU, why, what it costs and the fix."""
    global _warned
    if _warned:
        return
    _warned = True
    if os.environ.get("FPSCALE_TRITON_SCAN") == "0":
        why, fix = "FPSCALE_TRITON_SCAN=0", "unset FPSCALE_TRITON_SCAN"
    elif not _triton_fits(x, A):
        why = f"{str(x.dtype).removeprefix('torch.')} inputs, d_state {A.shape[-1]}"
        fix = f"give the scan float32 or bfloat16 inputs and d_state <= {MAX_D_STATE}"
    else:
        why = "triton is not installed"
        fix = "install triton (pip install triton; a CUDA torch wheel brings it)"
    log.warning("FP-Mamba's selective scan runs on its PyTorch fallback on this GPU (%s): about 400 kernel "
                "launches per scan call at T = 2048 (about 1000 with the backward), tens of times slower than "
                "a fused scan. To run fpscale's Triton scan, %s; or install mamba-ssm (pip install mamba-ssm "
                "--no-build-isolation). This warning is shown once per process.", why, fix)


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``selective_scan``'s contract (x, dt [B, T, c]; A [c, n] <= 0; B, C [B, T, n]; h0 [B, c, n]):
    y [B, T, c] and the last state [B, c, n], by mamba-ssm, the Triton scan or PyTorch (module doc)."""
    mamba = mamba_scan_for(x, h0)
    if mamba is not None:
        record_kernel("scan", "mamba-ssm")
        y, last = mamba(*(t.transpose(1, 2).contiguous() for t in (x, dt)), A.contiguous(),
                        *(t.transpose(1, 2).contiguous() for t in (B, C)), return_last_state=True)
        return y.transpose(1, 2), last.detach()
    triton_scan = triton_scan_for(x, A)
    if triton_scan is not None:
        record_kernel("scan", "triton")
        return triton_scan(x, dt, A, B, C, h0)
    if x.is_cuda:
        _warn_pytorch_on_gpu(x, A)
    record_kernel("scan", "pytorch")
    return selective_scan(x, dt, A, B, C, h0)
