"""Which kernels actually ran, counted at the call (not which ones imported).

Every dispatch point records the kernel it chose, once per call: attention
(``fpscale.layers.common.causal_attention``: ``flash-attn``, or ``sdpa`` with the dtype q, k and v
reached it in, since SDPA's flash backend takes only fp16/bf16) and FP-Mamba's selective scan
(``fpscale.ops.scan_kernels.scan``: ``mamba-ssm``, ``triton`` or ``pytorch``). The benches and the
smoke script report these counts, so a row labelled "flash" is one where flash-attn ran. What each
layer type will run on this machine, before anything runs: ``fpscale.ops.kernel_plan``.

    kernels.reset(); model(x); print(kernels.summary())     # e.g. "attention: flash-attn x12; scan: triton x6"

(The bundled Hugging Face export rewrites every "from fpscale..." line of a module it carries, docstrings
too: keep usage examples in that form out of them.)
"""
from __future__ import annotations

from collections import Counter

import torch

CALLS: Counter = Counter()         # (op, kernel) -> calls since the last reset


def counting() -> bool:
    """False while torch.compile traces (``solver.execution.compile``): a Python-side count there would break
    the graph, and the compiled code runs whatever kernels Inductor emitted, so it is not counted."""
    return not torch.compiler.is_compiling()


def ran(op: str, kernel: str) -> None:
    """Record one call of ``kernel`` for ``op`` ("attention", "scan")."""
    if counting():
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
