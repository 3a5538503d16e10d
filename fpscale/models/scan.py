"""The linear recurrence h_t = a_t * h_{t-1} + b_t of the selective scan, in plain PyTorch.

``scan`` is what the layers call: a custom autograd function whose backward is the adjoint
recurrence run backwards in time (delta_t = g_t + a_{t+1} delta_{t+1}; da_t = delta_t h_{t-1};
db_t = delta_t), itself one more scan. It saves only a and h for backward, instead of every
level of the doubling scan.

``chunked_scan`` is a parallel scan: a Hillis-Steele doubling scan (log2(chunk) elementwise
steps) inside each chunk, and a sequential carry between chunks. It never divides by a
cumulative product, so it is stable for any decay in [0, 1]. ``sequential_scan`` is the
step-by-step reference it is tested against. mamba-ssm's ``selective_scan_fn`` (which returns
C^T h + D u and the last state, without an initial state) could serve the full-sequence path on
GPU; it is not wired in yet because no GPU was available to check it against this scan.
"""
from __future__ import annotations

import torch


def sequential_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """a, b: [B, T, ...] -> h: [B, T, ...] with h_t = a_t h_{t-1} + b_t."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    out = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def _doubling_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan along dim 1 of the affine maps (a, b); returns (prod a, h from h0 = 0)."""
    T = a.shape[1]
    shift = 1
    while shift < T:
        a_prev = torch.cat([torch.ones_like(a[:, :shift]), a[:, :-shift]], 1)
        b_prev = torch.cat([torch.zeros_like(b[:, :shift]), b[:, :-shift]], 1)
        b = a * b_prev + b
        a = a * a_prev
        shift *= 2
    return a, b


def chunked_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None,
                 chunk: int = 64) -> torch.Tensor:
    """Same result as :func:`sequential_scan`, parallel within chunks of ``chunk`` steps."""
    outs = []
    carry = h0
    for start in range(0, a.shape[1], chunk):
        ca, cb = _doubling_scan(a[:, start:start + chunk], b[:, start:start + chunk])
        h = cb if carry is None else cb + ca * carry.unsqueeze(1)
        outs.append(h)
        carry = h[:, -1]
    return torch.cat(outs, 1)


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, h0, chunk):
        h = chunked_scan(a, b, h0, chunk)
        ctx.chunk = chunk
        ctx.has_h0 = h0 is not None
        ctx.save_for_backward(a, h, h0 if h0 is not None else torch.empty(0))
        return h

    @staticmethod
    def backward(ctx, grad_h):
        a, h, h0 = ctx.saved_tensors
        a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], 1)       # a_{t+1}, 0 after the end
        delta = chunked_scan(a_next.flip(1), grad_h.flip(1), None, ctx.chunk).flip(1)
        start = h0.unsqueeze(1) if ctx.has_h0 else torch.zeros_like(h[:, :1])
        h_prev = torch.cat([start, h[:, :-1]], 1)
        grad_h0 = a[:, 0] * delta[:, 0] if ctx.has_h0 else None
        return delta * h_prev, delta, grad_h0, None


def scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, chunk: int = 16) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t along dim 1, with a memory-lean backward."""
    return _Scan.apply(a, b, h0, chunk)
