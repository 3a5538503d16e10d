"""Causal attention and the optional GPU kernels' dispatch: flash-attn on CUDA in fp16/bf16 where it is
installed, PyTorch's SDPA (its flash / cuDNN / memory-efficient backends, or the math one on CPU)
otherwise. The reference is SDPA itself: tests/ops/test_flash_attn.py holds flash-attn to it where both
run. ``load_optional`` and ``wanted_kernel`` are the one rule every optional kernel follows (the
Mamba scan's too, fpscale.ops.scan_kernels).
"""
from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from fpscale.ops.kernels import counting as counting_kernels
from fpscale.ops.kernels import ran as record_kernel


def load_optional(module: str, attr: str):
    """(``module.attr``, None); (None, None) when its package is not installed; (None, the
    exception) when it is installed but does not import (a build for another CUDA or torch): that
    must not pass for "not installed" and run silently on the PyTorch fallback."""
    try:
        return getattr(importlib.import_module(module), attr), None
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module + ".").startswith(exc.name + "."):
            return None, None
        return None, exc
    except Exception as exc:      # OSError (undefined symbol), ImportError, RuntimeError ...
        return None, exc


def wanted_kernel(env: str, kernel, error: Exception | None, applicable: bool, what: str, pip: str,
                  fallback: str):
    """The optional GPU kernel ``kernel`` (from ``load_optional``) if this call should use it, else
    None. The environment variable ``env``: ``auto`` (default: where ``applicable`` and installed),
    ``0`` (never), ``1`` (required where applicable). Wanted but failing to import, or required but
    absent, is an error naming the package and ``env=0``, the way to ``fallback``."""
    mode = os.environ.get(env, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{env} must be auto, 0 or 1, got {mode!r}")
    if mode == "0" or not applicable:
        return None
    if kernel is None and (error is not None or mode == "1"):
        why = f"it fails to import: {error!r}" if error else "it is not installed"
        raise RuntimeError(f"{what} is wanted on this GPU but {why}. Install a build for this torch and CUDA "
                           f"(pip install {pip} --no-build-isolation), or set {env}=0 to {fallback}")
    return kernel


def load_flash_attn():
    """(flash_attn_func, None), or None and why not (``load_optional``; SDPA is used, as on CPU)."""
    return load_optional("flash_attn", "flash_attn_func")


FLASH_ATTN, FLASH_ATTN_ERROR = load_flash_attn()


def flash_attn_for(q) -> object | None:
    """flash-attn's function for this query, or None for SDPA. ``FPSCALE_FLASH_ATTN``: ``auto``
    (default: flash-attn on CUDA in fp16/bf16 when installed), ``0`` (never), ``1`` (required)."""
    return wanted_kernel("FPSCALE_FLASH_ATTN", FLASH_ATTN, FLASH_ATTN_ERROR,
                         q.is_cuda and q.dtype in (torch.float16, torch.bfloat16), "flash-attn", "flash-attn",
                         "run attention on PyTorch's SDPA")


def sdpa_label(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """``sdpa`` and the dtypes it was called with (``sdpa bf16``; mixed: ``sdpa q float32 k float32 v bfloat16``):
    SDPA's flash and cuDNN backends take only fp16/bf16 with q, k and v alike."""
    dtypes = [str(t.dtype).removeprefix("torch.") for t in (q, k, v)]
    if dtypes[0] == dtypes[1] == dtypes[2]:
        return "sdpa " + {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtypes[0], dtypes[0])
    return f"sdpa q {dtypes[0]} k {dtypes[1]} v {dtypes[2]}"


def causal_mask(pad: torch.Tensor | None, pos, length: int, n_keys: int, device) -> torch.Tensor:
    """The keys 0 .. n_keys - 1 each of ``length`` queries at positions pos, pos + 1, ... reads: those up to its
    own position, not a row's left padding (``pad`` [B]; a padded query reads itself): bool [Tq, Tk], or
    [B, 1, Tq, Tk] with ``pad``. ``pos`` an int (the queries at the end of the keys: Tk - Tq) or a 0-dim
    tensor (a static-shape decoding step, whose keys are the cache's whole capacity: fpscale.layers.step_cache)."""
    keys = torch.arange(n_keys, device=device)
    query = (pos + torch.arange(length, device=device))[:, None]
    mask = keys[None] <= query
    if pad is None:
        return mask
    return mask & ((keys >= pad[:, None, None, None]) | (keys == query))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: torch.Tensor | float | None = None, dropout_p: float = 0.0,
                     pad: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, Tq, dh] over k, v [B, H, Tk, dh] with Tk >= Tq.

    The query block sits at the end of the key sequence (decoding with a cache): the mask is
    aligned bottom-right. ``scale`` may be a per-head tensor [H] (FPSA temperature);
    ``dropout_p`` drops attention probabilities (training only: callers pass 0 in eval);
    ``pad`` [B] hides each row's left padding from every query (a padded query sees itself); a bool
    ``pad`` is the mask itself ([Tq, Tk] or [B, 1, Tq, Tk]: a static-shape decoding step, whose keys are
    the cache's whole capacity: ``causal_mask``).
    flash-attn is used on CUDA for fp16/bf16 without padding (``flash_attn_for``; a per-head scale
    is folded into q), so every attention inside a fixed-point map (fpsa, the looped core) runs on
    it; SDPA otherwise.
    """
    Tq, Tk = q.shape[-2], k.shape[-2]
    per_head = isinstance(scale, torch.Tensor)
    flash = None if pad is not None else flash_attn_for(q)
    if flash is not None:
        if per_head:   # flash-attn takes one scale: fold the per-head one into q
            q, scale = q * scale.view(1, -1, 1, 1).to(q.dtype), 1.0
        out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                    softmax_scale=scale, dropout_p=dropout_p)
        record_kernel("attention", "flash-attn")
        return out.transpose(1, 2)
    if counting_kernels():           # (the label's string work would break a torch.compile graph)
        record_kernel("attention", sdpa_label(q, k, v))
    if per_head:   # fold the per-head scale into q, keep SDPA's own scale at 1
        q = q * scale.view(1, -1, 1, 1).to(q.dtype)
        scale = 1.0
    if pad is not None and pad.dtype == torch.bool:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad, scale=scale, dropout_p=dropout_p)
    if Tq == Tk and pad is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
    mask = causal_mask(pad, Tk - Tq, Tq, Tk, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
