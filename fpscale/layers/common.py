"""Functional building blocks shared by every layer type: norms, RoPE, self-attention, SwiGLU,
spectral normalisation, the tensor-parallel split declarations (the attention kernels themselves
are in fpscale.ops.attention). Plain PyTorch on tensors, so a layer can run a whole
fixed-point solve inside one ``forward`` on its own parameters (what ZeRO-3 needs).
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fpscale.layers.step_cache import with_new
from fpscale.ops.attention import causal_attention
from fpscale.solvers.precision import wide


class TPSplit(NamedTuple):
    """How tensor parallelism splits one weight of a module (its ``tp_plan``): along ``dim`` into
    ``parallel.tp`` equal shards. ``parts`` > 1 means the tensor is that many equal sub-tensors
    along ``dim`` (fused q/k/v: 3), each split on its own, so shard r holds the r-th slice of
    every part. fpscale.parallel.parallelize applies the plans; the model code only declares them."""
    dim: int
    parts: int = 1


def attention_flops(d_model: int, seq_len: int) -> float:
    """Forward matmul FLOPs per token of a causal attention sublayer: q/k/v and output
    projections, then scores and values."""
    return 2 * 3 * d_model * d_model + 2 * d_model * d_model + attention_score_flops(d_model, seq_len)


def attention_score_flops(d_model: int, seq_len: int) -> float:
    """Q K^T and the weighted sum of V per token, over T/2 keys on average (causal)."""
    return 2 * 2 * (seq_len / 2) * d_model


def mlp_flops(d_model: int, hidden: int, kind: str = "swiglu") -> float:
    """Forward matmul FLOPs per token of an MLP: SwiGLU (gate, up, down) or ReLU^2 (fc, proj)."""
    return 2 * (2 if kind == "relu2" else 3) * d_model * hidden


class Unsharded:
    """How a layer's tensor-parallel shards meet; for a whole (unsharded) layer, the identity.

    ``fpscale.parallel.parallelize`` swaps in ``TensorParallelShards``, the same methods with the
    conjugate collectives of a Megatron TP region (forward / backward):
      enter(x)     a replicated x used by a sharded computation      identity / sum over shards
      exit(x)      partial results summed into a replicated value    sum / identity
      total(x)     a partial sum that every shard uses again         sum / sum   (= enter(exit(x)))
      gather(x)    the sharded last dim made whole (replicated)      all-gather / own slice
      scatter(x)   this shard's slice of a replicated last dim       own slice / all-gather
      rng()        a context in which random draws differ per shard (fpscale.parallel.random)
      consensus    the solver's stop flags, MAX over the shards (every shard iterates alike)
      state_reduce the solver's per-token norms summed / maxed over the shards, when the solved
                   state itself is split (fpmamba's channels); None when it is whole
    """
    consensus = None
    state_reduce = None

    def rng(self):
        """Context for random draws inside the region (dropout): the TP stream under TP."""
        return contextlib.nullcontext()

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in the weight's dtype: a float32 iterate meets bf16 weights (DeepSpeed's bf16
    mode) in a bf16 product. Under autocast the weights are float32 and autocast picks bf16."""
    return F.linear(x.to(w.dtype), w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm computed in at least float32; the result in the weight's dtype (x's without one),
    the dtype of the product it feeds."""
    out = F.rms_norm(wide(x), (x.shape[-1],), None, eps)
    return out.to(x.dtype) if weight is None else (out * weight).to(weight.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float, dtype: torch.dtype = torch.float32):
    """cos, sin of shape [*positions.shape, head_dim/2] for the given absolute positions, computed
    in float32 and returned in ``dtype`` (``rope_span`` asks for at least float32: see ``apply_rope``)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions.float()[..., None] * inv
    return ang.cos().to(dtype), ang.sin().to(dtype)


def positions_of(pos, length: int, device) -> torch.Tensor:
    """The positions [pos, pos + length) of a block of new tokens, [T] long; ``pos`` an int, or a 0-dim long
    tensor (a static-shape decoding step: the position is data, not a constant a compiled graph guards on)."""
    return pos + torch.arange(length, device=device)


def rope_span(head_dim: int, pos, length: int, theta: float, like: torch.Tensor,
              pad: torch.Tensor | None = None):
    """cos, sin for the positions [pos, pos + length) of a block of new tokens: [T, head_dim/2];
    with left padding (``pad``, see ``real_tokens``) each row counts from its first real token:
    [B, 1, T, head_dim/2]. The tables are in at least float32 whatever ``like``'s dtype (a bf16
    model's too): ``apply_rope`` rotates in them and rounds the result to what it rotates."""
    positions = positions_of(pos, length, like.device)
    dtype = torch.promote_types(like.dtype, torch.float32)
    if pad is None:
        return rope_tables(head_dim, positions, theta, dtype)
    cos, sin = rope_tables(head_dim, (positions[None] - pad[:, None]).clamp_min(0), theta, dtype)
    return cos[:, None], sin[:, None]


def real_tokens(pad: torch.Tensor | None, pos, length: int) -> torch.Tensor | None:
    """Which of the new tokens [pos, pos + length) are real: [B, T] bool, or None without padding.

    ``pad`` [B] counts each row's left padding: positions below pad[b] are padding. A padded
    position contributes nothing that a real token reads (attention keys, conv and scan inputs,
    HQSA bins, the solver's stop test), so a padded row computes what the row alone computes.
    """
    if pad is None:
        return None
    return positions_of(pos, length, pad.device)[None] >= pad[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, dh] by position (pairs of halves, as in GPT-NeoX/Llama); the result is in
    x's dtype, so q and k leave RoPE in the dtype v has (bf16 under autocast or a bf16 model) and
    reach attention alike (SDPA's fused backends and flash-attn take only q, k, v of one fp16/bf16
    dtype).

    The rotation itself runs in the tables' dtype (float32 from ``rope_span``; type promotion
    widens a bf16 x exactly) and is rounded to x's dtype once, as torchtitan does (freqs_cis in
    float32, the rotated q/k ``type_as`` the input). Megatron (its unfused rope) and HF Llama cast
    cos/sin to bf16 and rotate in bf16: three roundings (tables, products, sum) instead of one,
    for an elementwise op whose cost beside the projections is nil. A float32 x is rotated
    exactly as before (float32 tables, float32 products: the ``.to`` is a no-op)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def self_attention(h: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, head_dim: int, cos, sin,
                   past: dict | None = None, dropout_p: float = 0.0, pad: torch.Tensor | None = None,
                   qk_norm: bool = False, v_extra: torch.Tensor | None = None):
    """Causal attention of h with fused q/k/v weights; ``past`` holds cached k, v of earlier
    tokens; ``pad`` the rows' left padding (or a static step's mask: ``causal_mask``). Returns
    (output, k, v) with k, v the new tokens' (what a cache keeps of them). ``qk_norm``: q and k
    get a parameter-free RMSNorm over each head after RoPE (eps: the dtype's machine epsilon,
    F.rms_norm's default), as jacobfa/Attractor does (attractor/modules/mixer.py:13-15, 80-81);
    the cache then holds normalised keys."""
    q, k, v = F.linear(h, w_qkv).chunk(3, dim=-1)
    if v_extra is not None:            # value embeddings (fpscale.layers.switches.ValueEmbedding)
        v = v + v_extra.to(v.dtype)
    q, k, v = (split_heads(t, head_dim) for t in (q, k, v))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if qk_norm:
        q, k = F.rms_norm(q, (head_dim,)), F.rms_norm(k, (head_dim,))
    k_all, v_all = k, v
    if past and "k" in past:     # cached tensors, or TokenBuffers written in place (fpscale.layers.step_cache)
        k_all, v_all = with_new(past["k"], k, 2), with_new(past["v"], v, 2)
    return F.linear(merge_heads(causal_attention(q, k_all, v_all, dropout_p=dropout_p, pad=pad)), w_o), k, v


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, past: torch.Tensor | None,
                real: torch.Tensor | None = None):
    """Causal depthwise conv over time of x [B, T, C]; ``past`` holds the last k - 1 inputs of
    earlier tokens (decoding); ``real`` [B, T] (``real_tokens``) zeroes padded inputs, as the
    zeros before the first token. Returns (output [B, T, C], the window to cache)."""
    k = weight.shape[-1]
    if real is not None:
        x = x.masked_fill(~real[..., None], 0.0)
    window = torch.cat([past, x], 1) if past is not None else F.pad(x, (0, 0, k - 1, 0))
    out = F.conv1d(window.transpose(1, 2), weight, bias, groups=x.shape[-1]).transpose(1, 2)[:, -x.shape[1]:]
    return out, window[:, window.shape[1] - (k - 1):]


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    B, T, D = x.shape
    return x.view(B, T, D // head_dim, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, H, T, dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * dh)


def swiglu_hidden(d_model: int, mlp_ratio: float, multiple_of: int = 16) -> int:
    hidden = int(mlp_ratio * d_model)
    return multiple_of * math.ceil(hidden / multiple_of)


def spectral_normalize(w: torch.Tensor, u: torch.Tensor, n_iter: int, update: bool,
                       total=lambda t: t) -> torch.Tensor:
    """w / sigma_max(w) with a persistent power-iteration vector ``u`` (updated in place).

    As in torch's spectral_norm: the power iteration runs without grad; sigma = u^T W v
    carries the gradient. ``u`` has shape [w.shape[0]]. When the rows of W are split over
    tensor-parallel shards (w, u: this shard's rows), ``total`` sums the shards' partial
    products, so every shard divides by the sigma of the whole matrix. The power iteration and
    sigma run in at least float32 with autocast off (bf16 weights, or autocast, would round them).
    """
    with torch.autocast(w.device.type, enabled=False):
        w32 = wide(w)

        def right(uu):                                   # v = normalize(W^T u)
            return F.normalize(total(w32.detach().t() @ uu), dim=0, eps=1e-12)

        if update:
            with torch.no_grad():
                uu = wide(u)
                for _ in range(n_iter):
                    wv = w32 @ right(uu)
                    uu = wv / total(wv.pow(2).sum()).sqrt().clamp_min(1e-12)
                u.copy_(uu)
        uu = wide(u.detach())
        v = right(uu).detach()
        sigma = total(torch.dot(uu, w32 @ v))
    return w / sigma.to(w.dtype)


def init_linear(w: torch.Tensor, std: float) -> None:
    torch.nn.init.normal_(w, mean=0.0, std=std)


def mlp_tp_divisor(cfg) -> tuple[str, int]:
    """What tensor parallelism splits in an ``MLP`` of the model: its hidden units."""
    return "the SwiGLU hidden size", swiglu_hidden(cfg.d_model, cfg.mlp_ratio)


class MLP(torch.nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). gate/up are column-parallel, down row-parallel."""

    def __init__(self, d_model: int, mlp_ratio: float, init_std: float, out_std: float):
        super().__init__()
        hidden = swiglu_hidden(d_model, mlp_ratio)
        self.w_gate = torch.nn.Parameter(torch.empty(hidden, d_model))
        self.w_up = torch.nn.Parameter(torch.empty(hidden, d_model))
        self.w_down = torch.nn.Parameter(torch.empty(d_model, hidden))
        init_linear(self.w_gate, init_std)
        init_linear(self.w_up, init_std)
        init_linear(self.w_down, out_std)
        self.shards = Unsharded()           # tensor parallelism: this shard's hidden units

    def tp_plan(self) -> dict[str, TPSplit]:
        return {"w_gate": TPSplit(0), "w_up": TPSplit(0), "w_down": TPSplit(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.exit(swiglu(self.shards.enter(x), self.w_gate, self.w_up, self.w_down))
