"""Histogram-quantised scalar attention (seed 003, Epsilon, Sec. 3.3), made causal.

Per head, keys are soft-assigned to B learned prototypes and every query attends over the B
mass-normalised bins instead of the T tokens:

    a_ib = softmax_b(W_bin k_i . U_b / tau)                    (``bin_assignment``)
    K_b(j) = sum_{i<=j} a_ib k_i / (m_b(j) + eps),  V_b(j) likewise,  m_b(j) = sum_{i<=j} a_ib
    out_j = sum_b softmax_b(q_j . K_b(j) / sqrt(d_h)) V_b(j)

The paper sums over the whole sequence (a bidirectional classifier): every query would see the
future. Summing only the prefix i <= j makes it causal; the prefix sums are computed chunk by
chunk (Mamba-2's SSD pattern) so nothing of size T x B x d_h is materialised:

    within a chunk of C tokens   masked C x C products (q k^T and g a^T)
    across chunks                the running sums S_K, S_V [B, d_h] and m [B] of earlier chunks

which costs O(T (C + B) d_h) per head, against O(T^2 d_h) for attention. Decoding carries the
running sums of the prefix (``past``): O(B d_h) per head whatever the length. Sums and softmaxes
run in at least float32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpscale.layers.common import wide

MASS_EPS = 1e-6      # eps of the mass normalisation (the authors' 1e-6)
CHUNK = 64           # tokens per chunk of the prefix sums


def bin_assignment(k: torch.Tensor, w_bin: torch.Tensor, prototypes: torch.Tensor,
                   log_tau: torch.Tensor) -> torch.Tensor:
    """a [B, H, T, bins]: keys k [B, H, T, d_h] projected by the shared W_bin [d_lat, d_h] and
    soft-assigned to each head's prototypes [H, bins, d_lat] at temperature exp(log_tau) [H]
    (clamped at 1e-3, as the authors do)."""
    z = F.linear(k, w_bin.to(k.dtype))
    logits = wide(z @ prototypes.to(z.dtype).transpose(-1, -2))
    tau = wide(log_tau).exp().clamp_min(1e-3).view(1, -1, 1, 1)
    return torch.softmax(logits / tau, dim=-1)


def assignment_entropy(a: torch.Tensor) -> torch.Tensor:
    """Per-key entropy of the bin assignment, summed over heads and averaged over tokens: [ ]
    (divide by the number of heads for the mean per head).

    a log a with the log's argument clamped at the dtype's smallest normal: the same value as ``xlogy(a, a)``
    (0 log 0 = 0) and the same gradient where a > 0, but a finite one where a softmax underflowed to an
    exact 0: xlogy's derivative in its second argument there is 0 / 0 = NaN, which made every training
    step of tiny_epsilon non-finite (and skipped) from step 51 on the bundled corpus at e2f0e12."""
    return -(a * a.clamp_min(torch.finfo(a.dtype).tiny).log()).sum(-1).sum(1).mean()


def causal_hqsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, past: dict | None = None,
                dropout_p: float = 0.0, chunk: int = CHUNK) -> tuple[torch.Tensor, dict]:
    """Causal HQSA of q, k, v [B, H, T, d_h] with bin assignments a [B, H, T, bins].

    ``past``: the running sums of earlier tokens {"k": [B, H, bins, d_h], "v": ..., "m": [B, H, bins]}
    (decoding). Returns (out [B, H, T, d_h] in q's dtype, the running sums after the last token)."""
    B, H, T, dh = q.shape
    f = torch.promote_types(q.dtype, torch.float32)
    q, k, v, a = (t.to(f) for t in (q, k, v, a))
    C = min(chunk, T)
    pad = (-T) % C
    if pad:            # padded tokens have a = 0: they add nothing to any sum, their outputs are cut
        q, k, v, a = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, a))
    n = (T + pad) // C
    q, k, v, a = (t.view(B, H, n, C, t.shape[-1]) for t in (q, k, v, a))
    at = a.transpose(-1, -2)                                      # [B, H, n, bins, C]
    chunk_k, chunk_v, chunk_m = at @ k, at @ v, a.sum(-2)         # what each chunk adds
    # the sums of every earlier chunk (and of the past), exclusive of this chunk: shifted, not
    # subtracted (a later chunk's rounding must not reach an earlier token)
    prev_k, prev_v, prev_m = (torch.cat([torch.zeros_like(s[:, :, :1]), s[:, :, :-1].cumsum(2)], 2)
                              for s in (chunk_k, chunk_v, chunk_m))
    if past:
        prev_k = prev_k + past["k"].to(f)[:, :, None]
        prev_v = prev_v + past["v"].to(f)[:, :, None]
        prev_m = prev_m + past["m"].to(f)[:, :, None]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    inv_mass = 1.0 / (prev_m[..., None, :] + a.cumsum(-2) + MASS_EPS)       # [B, H, n, C, bins]
    qk = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)                # [B, H, n, C, C]
    scores = (q @ prev_k.transpose(-1, -2) + qk @ a) * inv_mass / math.sqrt(dh)
    w = torch.softmax(scores, dim=-1)
    if dropout_p:
        w = F.dropout(w, dropout_p)
    g = w * inv_mass                                              # weights of the unnormalised bin sums
    out = g @ prev_v + (g @ at).masked_fill(~causal, 0.0) @ v
    out = out.view(B, H, n * C, dh)[:, :, :T]
    state = {"k": prev_k[:, :, -1] + chunk_k[:, :, -1], "v": prev_v[:, :, -1] + chunk_v[:, :, -1],
             "m": prev_m[:, :, -1] + chunk_m[:, :, -1]}
    return out, state


def hqsa_flops(d_model: int, n_heads: int, bins: int, latent: int, seq_len: int) -> float:
    """Forward matmul FLOPs per token of ``bin_assignment`` + ``causal_hqsa`` (beyond the q/k/v/o
    projections), as executed: per head the bin projection and prototype logits, the chunk sums
    and their reads (a^T k, a^T v, q S_K, g S_V), and the chunk-local C x C products (whole, as
    computed: q k^T, (q k^T) a, g a^T, and the product with v)."""
    dh, C = d_model // n_heads, min(CHUNK, seq_len)
    per_head = 2 * latent * (dh + bins) + 8 * bins * dh + 4 * C * (dh + bins)
    return n_heads * per_head
