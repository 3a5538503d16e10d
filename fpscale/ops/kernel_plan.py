"""Which kernels each layer type will run on this machine, from the dispatchers' own state (what
imported, the switches): the line scripts/setup.sh prints. What actually runs is counted at the call
(``fpscale.ops.kernels``).

    python -c "from fpscale.ops.kernel_plan import describe; print(describe())"
"""
from __future__ import annotations

import os

from fpscale.ops import attention, scan_kernels


def _choice(switch: str, kernel, error, name: str) -> str | None:
    """``name`` if an optional kernel would be used (installed and not switched off), else None; an
    installed one that fails to import is named with its error (the layer will refuse to run)."""
    if os.environ.get(switch, "auto") == "0":
        return None
    if error is not None:
        return f"{name} fails to import ({error!r}; set {switch}=0 to skip it)"
    return name if kernel is not None else None


ATTENTION = "attention (attn, fpsa, looped; epsilon with attention: causal)"
FPMAMBA2_CPU = "PyTorch (chunked SSD)"
FPMAMBA2_CUDA = "the fpmamba scan, per group of heads (fpscale.ops.ssd)"


def plan(cuda: bool) -> dict[str, str]:
    """{what: kernel} that the dispatchers will choose, by layer type, on a CUDA device in bf16 or on
    CPU: the line scripts/setup.sh prints. What actually runs is counted at the call (``fpscale.ops.kernels``)."""
    if not cuda:
        return {ATTENTION: "SDPA", "fpmamba scan": "PyTorch (chunked)", "fpmamba2 scan": FPMAMBA2_CPU}
    flash = _choice("FPSCALE_FLASH_ATTN", attention.FLASH_ATTN, attention.FLASH_ATTN_ERROR, "flash-attn")
    mamba = _choice("FPSCALE_MAMBA_SCAN", scan_kernels.MAMBA_SCAN, scan_kernels.MAMBA_SCAN_ERROR, "mamba-ssm")
    triton = _choice("FPSCALE_TRITON_SCAN", scan_kernels.TRITON_SCAN, scan_kernels.TRITON_SCAN_ERROR, "Triton")
    slow = "PyTorch (chunked: about 400 launches a call, tens of times slower; install triton)"
    return {ATTENTION: flash or "SDPA (its flash/cuDNN backends in bf16)",
            "fpmamba scan": (f"{mamba} (decoding: {triton or slow})" if mamba else triton or slow),
            "fpmamba2 scan": FPMAMBA2_CUDA}


def describe() -> str:
    """``plan`` for this machine's device, in one line."""
    import torch
    cuda = torch.cuda.is_available()
    return f"kernels on {'cuda' if cuda else 'cpu'}: " + "; ".join(f"{k}: {v}" for k, v in plan(cuda).items())
