"""``attn``: the baseline pre-norm block, causal multi-head attention with RoPE + SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fpscale.models.common import (RMSNorm, apply_rope, causal_attention, init_linear, merge_heads,
                                   rope_tables, split_heads, swiglu_hidden)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


class Attention(torch.nn.Module):
    """Causal self-attention with RoPE and an optional KV cache for decoding."""

    def __init__(self, d_model: int, n_heads: int, rope_theta: float, init_std: float, out_std: float):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.w_qkv = torch.nn.Parameter(torch.empty(3 * d_model, d_model))
        self.w_o = torch.nn.Parameter(torch.empty(d_model, d_model))
        init_linear(self.w_qkv, init_std)
        init_linear(self.w_o, out_std)

    def forward(self, h: torch.Tensor, pos: int = 0, cache: dict | None = None) -> torch.Tensor:
        q, k, v = (split_heads(t, self.head_dim) for t in F.linear(h, self.w_qkv).chunk(3, dim=-1))
        positions = torch.arange(pos, pos + h.shape[1], device=h.device)
        cos, sin = rope_tables(self.head_dim, positions, self.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        return F.linear(merge_heads(causal_attention(q, k, v)), self.w_o)


class AttnBlock(torch.nn.Module):
    def __init__(self, cfg, spec, index: int):
        super().__init__()
        out_std = cfg.init_std / (2 * len(cfg.expanded_layers())) ** 0.5
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.rope_theta, cfg.init_std, out_std)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio, cfg.init_std, out_std)

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pos, cache)
        return x + self.mlp(self.norm2(x))
