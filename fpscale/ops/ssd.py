"""FP-Mamba2's scan: Mamba-2's SSD, one scalar decay per head, B and C shared by groups of heads.

    h_t[h] = exp(dt_t[h] A[h]) h_{t-1}[h] + dt_t[h] x_t[h] B_t[g(h)]^T      h_t[h]: [P, N]
    y_t[h] = h_t[h] C_t[g(h)]                                              g(h) = h // (H / G)

x [B, T, H, P], dt [B, T, H] (>= 0), A [H] (<= 0), B, C [B, T, G, N], h0 [B, H, P, N] or None;
returns y [B, T, H, P] and the last state [B, H, P, N] (the decode cache, not differentiated).

``ssd_scan`` is the chunked form in PyTorch (Dao & Gu 2024, "SSD"): with one decay per head the
decay from step j to step i inside a chunk is exp(cs_i - cs_j), cs the cumulative sum of dt A, so
each chunk of L steps is a masked [L, L] product (C_i . B_j times that decay, applied to dt_j x_j)
plus the contribution of the state entering the chunk, exp(cs_i) C_i . H_c; the states entering the
chunks follow from one short recurrence over the T / L chunks, H_{c+1} = exp(cs_L) H_c + S_c, S_c
the chunk's own end state. Autograd differentiates it; the state of every step is never stored
(the chunk-start states, [B, T / L, H, P, N], and the [L, L] decays of each chunk are).

``ssd`` dispatches: on CPU ``ssd_scan``; on a CUDA tensor (and on CPU under Triton's interpreter
with ``FPSCALE_TRITON_SCAN=1``, as fpscale.ops.scan_kernels) the same recurrence as the
Mamba-1 selective scan of each group's heads with A constant over a head's channels and states
(``via_selective_scan``): fpscale.ops.scan_kernels.scan, i.e. mamba-ssm's or fpscale's Triton
kernel (fpscale.ops.scan_triton), which run one fused launch where the chunked PyTorch form
launches dozens of small kernels per chunk loop. A dedicated SSD kernel (the chunk products on
tensor cores, as mamba-ssm's ``mamba_chunk_scan_combined``, which the authors call) is not written.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fpscale.ops.kernels import ran as record_kernel
from fpscale.ops.scan_kernels import scan
from fpscale.ops.scan_triton import INTERPRET
from fpscale.solvers.precision import wide

DEFAULT_CHUNK = 64


def reference_ssd_scan(x, dt, A, B, C, h0=None):
    """The recurrence step by step (the tests' reference; float64 in, float64 out)."""
    Bsz, T, H, P = x.shape
    G = B.shape[2]
    Bh, Ch = (t.repeat_interleave(H // G, dim=2) for t in (B, C))          # [B, T, H, N]
    h = torch.zeros(Bsz, H, P, B.shape[-1], dtype=x.dtype) if h0 is None else h0
    ys = []
    for t in range(T):
        a = torch.exp(dt[:, t] * A)[:, :, None, None]
        h = a * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             h0: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD in PyTorch (module doc), computed in at least float32."""
    out_dtype = x.dtype
    x, dt, A, B, C = (wide(t) for t in (x, dt, A, B, C))
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    Hg = H // G
    L = min(chunk, T)
    pad = (-T) % L
    if pad:          # dt = 0 past T: decay 1 and no input, the state is held
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    nc = x.shape[1] // L
    xc = x.view(Bsz, nc, L, G, Hg, P)
    dtc = dt.view(Bsz, nc, L, G, Hg)
    Bc, Cc = B.view(Bsz, nc, L, G, N), C.view(Bsz, nc, L, G, N)
    cs = torch.cumsum(dtc * A.view(G, Hg), dim=2)                         # [B, nc, L, G, Hg], <= 0
    seg = cs[:, :, :, None] - cs[:, :, None, :]                           # [B, nc, L(i), L(j), G, Hg]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[:, :, None, None], float("-inf")))
    w = dtc[..., None] * xc                                               # dt_j x_j  [B, nc, L, G, Hg, P]
    cb = torch.einsum("bcign,bcjgn->bcijg", Cc, Bc)
    y = torch.einsum("bcijg,bcijgk,bcjgkp->bcigkp", cb, decay, w)          # within each chunk
    to_end = torch.exp(cs[:, :, -1:] - cs)                                # decay from j to the chunk's end
    S = torch.einsum("bcjgk,bcjgkp,bcjgn->bcgkpn", to_end, w, Bc)          # each chunk's own end state
    total = torch.exp(cs[:, :, -1])                                       # [B, nc, G, Hg]
    state = (torch.zeros(Bsz, G, Hg, P, N, dtype=x.dtype, device=x.device) if h0 is None
             else wide(h0).view(Bsz, G, Hg, P, N))
    starts = []
    for c in range(nc):
        starts.append(state)
        state = total[:, c, :, :, None, None] * state + S[:, c]
    Hs = torch.stack(starts, 1)                                           # [B, nc, G, Hg, P, N]
    y = y + torch.exp(cs)[..., None] * torch.einsum("bcign,bcgkpn->bcigkp", Cc, Hs)
    y = y.reshape(Bsz, nc * L, H, P)[:, :T]
    return y.to(out_dtype), state.reshape(Bsz, H, P, N).detach().to(out_dtype)


def via_selective_scan(x, dt, A, B, C, h0=None):
    """The SSD as fpscale.ops.scan_kernels.scan (the Mamba-1 selective scan) per group: the
    group's heads' channels with dt and A repeated over each head's P channels, A over the N states."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    Hg = H // G
    ys, lasts = [], []
    for g in range(G):
        heads = slice(g * Hg, (g + 1) * Hg)
        xg = x[:, :, heads].reshape(Bsz, T, Hg * P)
        dtg = dt[:, :, heads].repeat_interleave(P, dim=-1)
        Ag = A[heads].repeat_interleave(P)[:, None].expand(Hg * P, N).contiguous()
        h0g = None if h0 is None else h0[:, heads].reshape(Bsz, Hg * P, N)
        y, last = scan(xg, dtg, Ag, B[:, :, g], C[:, :, g], h0g)
        ys.append(y.view(Bsz, T, Hg, P))
        lasts.append(last.view(Bsz, Hg, P, N))
    return torch.cat(ys, 2), torch.cat(lasts, 1)


def fused_wanted(x: torch.Tensor) -> bool:
    """Whether ``ssd`` takes the fused selective-scan kernels: on CUDA, or on CPU when Triton's
    interpreter runs them (``TRITON_INTERPRET=1`` and ``FPSCALE_TRITON_SCAN=1``)."""
    return x.is_cuda or (INTERPRET and os.environ.get("FPSCALE_TRITON_SCAN") == "1")


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP-Mamba2's scan (module doc): y [B, T, H, P] and the last state [B, H, P, N]."""
    if fused_wanted(x):
        record_kernel("ssd", "selective-scan")
        return via_selective_scan(x, dt, A, B, C, h0)
    record_kernel("ssd", "pytorch")
    return ssd_scan(x, dt, A, B, C, h0)
