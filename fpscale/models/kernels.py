"""Which kernels actually ran, counted at the call (not which ones imported).

Every dispatch point records the kernel it chose, once per call: attention
(``fpscale.models.common.causal_attention``: ``flash-attn``, or ``sdpa`` with the dtype q, k and v
reached it in, since SDPA's flash backend takes only fp16/bf16) and FP-Mamba's selective scan
(``fpscale.models.scan_kernels.scan``: ``mamba-ssm``, ``triton`` or ``pytorch``). The benches and the
smoke script report these counts, so a row labelled "flash" is one where flash-attn ran.

    from fpscale.models import kernels
    kernels.reset(); model(x); print(kernels.summary())     # e.g. "attention: flash-attn x12; scan: triton x6"
    python -c "from fpscale.models.kernels import describe; print(describe())"   # what each layer type will use
"""
from __future__ import annotations

import os
from collections import Counter

CALLS: Counter = Counter()         # (op, kernel) -> calls since the last reset


def ran(op: str, kernel: str) -> None:
    """Record one call of ``kernel`` for ``op`` ("attention", "scan")."""
    CALLS[(op, kernel)] += 1


def reset() -> None:
    CALLS.clear()


def used() -> dict[str, dict[str, int]]:
    """{op: {kernel: calls}} since the last reset."""
    out: dict[str, dict[str, int]] = {}
    for (op, kernel), n in sorted(CALLS.items()):
        out.setdefault(op, {})[kernel] = n
    return out


def summary(counts: dict[str, dict[str, int]] | None = None) -> str:
    """One line: ``attention: flash-attn x12; scan: triton x6`` (``-`` when nothing ran)."""
    counts = used() if counts is None else counts
    return "; ".join(f"{op}: " + ", ".join(f"{k} x{n}" for k, n in ks.items()) for op, ks in counts.items()) or "-"


def _choice(switch: str, kernel, error, name: str) -> str | None:
    """``name`` if an optional kernel would be used (installed and not switched off), else None; an
    installed one that fails to import is named with its error (the layer will refuse to run)."""
    if os.environ.get(switch, "auto") == "0":
        return None
    if error is not None:
        return f"{name} fails to import ({error!r}; set {switch}=0 to skip it)"
    return name if kernel is not None else None


ATTENTION = "attention (attn, fpsa, looped; epsilon with attention: causal)"


def plan(cuda: bool) -> dict[str, str]:
    """{what: kernel} that the dispatchers will choose, by layer type, on a CUDA device in bf16 or on
    CPU: the line scripts/setup.sh prints. What actually runs is counted at the call (``used``)."""
    from fpscale.models import common, scan_kernels
    if not cuda:
        return {ATTENTION: "SDPA", "fpmamba scan": "PyTorch (chunked)"}
    flash = _choice("FPSCALE_FLASH_ATTN", common.FLASH_ATTN, common.FLASH_ATTN_ERROR, "flash-attn")
    mamba = _choice("FPSCALE_MAMBA_SCAN", scan_kernels.MAMBA_SCAN, scan_kernels.MAMBA_SCAN_ERROR, "mamba-ssm")
    triton = _choice("FPSCALE_TRITON_SCAN", scan_kernels.TRITON_SCAN, scan_kernels.TRITON_SCAN_ERROR, "Triton")
    slow = "PyTorch (chunked: about 400 launches a call, tens of times slower; install triton)"
    return {ATTENTION: flash or "SDPA (its flash/cuDNN backends in bf16)",
            "fpmamba scan": (f"{mamba} (decoding: {triton or slow})" if mamba else triton or slow)}


def describe() -> str:
    """``plan`` for this machine's device, in one line."""
    import torch
    cuda = torch.cuda.is_available()
    return f"kernels on {'cuda' if cuda else 'cpu'}: " + "; ".join(f"{k}: {v}" for k, v in plan(cuda).items())
