"""``attn``: the baseline pre-norm block, causal multi-head attention with RoPE + SwiGLU MLP."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fpscale.layers.checkpointing import applies, layer_mode, recompute
from fpscale.layers.common import (
    MLP,
    RMSNorm,
    TPSplit,
    Unsharded,
    attention_flops,
    init_linear,
    mlp_flops,
    mlp_tp_divisor,
    rope_span,
    self_attention,
    swiglu_hidden,
)
from fpscale.layers.registry import LayerSpec


def heads_and_mlp(cfg) -> list[tuple[str, int]]:
    """What tensor parallelism splits in an attention + MLP block: heads and hidden units."""
    return [("model.n_heads", cfg.n_heads), mlp_tp_divisor(cfg)]


@dataclass
class AttnSpec(LayerSpec):
    """``attn``: one pass of attention + MLP (no fields of its own)."""

    type: str = "attn"

    def build(self, cfg, solver=None) -> torch.nn.Module:
        return AttnBlock(cfg, self)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        hidden = swiglu_hidden(cfg.d_model, cfg.mlp_ratio)
        return attention_flops(cfg.d_model, seq_len) + mlp_flops(cfg.d_model, hidden), 0.0


class Attention(torch.nn.Module):
    """Causal self-attention with RoPE and an optional KV cache for decoding."""

    def __init__(self, d_model: int, n_heads: int, rope_theta: float, init_std: float, out_std: float,
                 dropout: float = 0.0):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.rope_theta, self.dropout = rope_theta, dropout
        self.w_qkv = torch.nn.Parameter(torch.empty(3 * d_model, d_model))
        self.w_o = torch.nn.Parameter(torch.empty(d_model, d_model))
        init_linear(self.w_qkv, init_std)
        init_linear(self.w_o, out_std)
        self.shards = Unsharded()           # tensor parallelism: this shard's heads

    def tp_plan(self) -> dict[str, TPSplit]:
        return {"w_qkv": TPSplit(0, parts=3), "w_o": TPSplit(1)}     # [q; k; v], each split by heads

    def forward(self, h: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope_span(self.head_dim, pos, h.shape[1], self.rope_theta, h, pad)
        with self.shards.rng():         # attention dropout: a mask per head, so per TP shard
            out, k, v = self_attention(self.shards.enter(h), self.w_qkv, self.w_o, self.head_dim, cos, sin, cache,
                                       self.dropout if self.training else 0.0, pad)
        if cache is not None:
            cache["k"], cache["v"] = k, v
        return self.shards.exit(out)


class AttnBlock(torch.nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)). Subclasses swap the attention.

    ``checkpoint`` (fpscale.layers.checkpointing): ``mlp`` recomputes the MLP sublayer in backward,
    ``block`` the whole block; a subclass whose attention is a solve (``looped_attention``) never
    recomputes it: ``block`` then recomputes the MLP sublayer only."""

    looped_attention = False

    def __init__(self, cfg, spec, solver=None):
        super().__init__()
        out_std = cfg.out_init_std()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = self.make_attention(cfg, spec, solver, out_std)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio, cfg.init_std, out_std)
        self.dropout = cfg.dropout
        self.checkpoint = layer_mode(cfg, spec)

    def make_attention(self, cfg, spec, solver, out_std: float) -> torch.nn.Module:
        return Attention(cfg.d_model, cfg.n_heads, cfg.rope_theta, cfg.init_std, out_std, cfg.attn_dropout)

    def attn_sublayer(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                      pad: torch.Tensor | None = None) -> torch.Tensor:
        return x + F.dropout(self.attn(self.norm1(x), pos, cache, pad), self.dropout, self.training)

    def mlp_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.mlp(self.norm2(x)), self.dropout, self.training)

    def plain(self, x: torch.Tensor, pos: int, pad: torch.Tensor | None) -> torch.Tensor:
        return self.mlp_sublayer(self.attn_sublayer(x, pos, None, pad))

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        mode = self.checkpoint if applies(cache) else "none"
        if mode == "block" and not self.looped_attention:
            return recompute(self.plain, (self.attn, self.mlp), x, pos, pad)
        x = self.attn_sublayer(x, pos, cache, pad)
        if mode == "none":
            return self.mlp_sublayer(x)
        return recompute(self.mlp_sublayer, (self.mlp,), x)
