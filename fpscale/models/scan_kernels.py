"""Which selective scan FP-Mamba runs: mamba-ssm's CUDA kernel for the full-sequence path on a GPU
when it is installed, else the chunked PyTorch scan (fpscale.models.scan).

``FPSCALE_MAMBA_SCAN``: ``auto`` (default: mamba-ssm on CUDA when installed, for a scan without an
initial state; decoding carries a state, which mamba-ssm's ``selective_scan_fn`` does not take),
``0`` (never), ``1`` (required on CUDA). An installed mamba-ssm that fails to import (a build for
another CUDA or torch) is an error that names the switch, not a silent fallback, as for flash-attn
(fpscale.models.common.flash_attn_for).

    python -m pytest tests/models/test_scan.py -q
"""
from __future__ import annotations

import torch

from fpscale.models.common import load_optional, wanted_kernel
from fpscale.models.scan import selective_scan


def load_mamba_scan():
    """(selective_scan_fn, None), or None and why not (``load_optional``)."""
    return load_optional("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn")


MAMBA_SCAN, MAMBA_SCAN_ERROR = load_mamba_scan()


def mamba_scan_for(x: torch.Tensor, h0: torch.Tensor | None):
    """mamba-ssm's selective_scan_fn for this input, or None for the PyTorch scan."""
    return wanted_kernel("FPSCALE_MAMBA_SCAN", MAMBA_SCAN, MAMBA_SCAN_ERROR, x.is_cuda and h0 is None,
                         "mamba-ssm's selective scan", "mamba-ssm", "run FP-Mamba's scan in PyTorch")


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``selective_scan``'s contract (x, dt [B, T, c]; A [c, n] <= 0; B, C [B, T, n]; h0 [B, c, n]):
    y [B, T, c] and the last state [B, c, n], by mamba-ssm where ``mamba_scan_for`` picks it."""
    kernel = mamba_scan_for(x, h0)
    if kernel is None:
        return selective_scan(x, dt, A, B, C, h0)
    y, last = kernel(*(t.transpose(1, 2).contiguous() for t in (x, dt)), A.contiguous(),
                     *(t.transpose(1, 2).contiguous() for t in (B, C)), return_last_state=True)
    return y.transpose(1, 2), last.detach()
