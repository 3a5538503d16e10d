"""``attn``: the baseline pre-norm block, causal multi-head attention with RoPE + SwiGLU MLP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fpscale.errors import check
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
from fpscale.layers.step_cache import TokenBuffer, attention_keys, is_static
from fpscale.layers.switches import INITS, MLP_KINDS, VE_GATE_CHANNELS, Relu2MLP, ValueEmbedding, scaled_zero_ortho_


def heads_and_mlp(cfg) -> list[tuple[str, int]]:
    """What tensor parallelism splits in an attention + MLP block: heads and hidden units."""
    return [("model.n_heads", cfg.n_heads), mlp_tp_divisor(cfg)]


def check_switches(spec, prefix: str) -> None:
    """The block switches ``mlp``, ``init`` (and the boolean ``qk_norm``) of attn and attractor."""
    check(spec.mlp in MLP_KINDS, f"{prefix}.mlp", f"must be one of {', '.join(MLP_KINDS)}, got {spec.mlp!r}")
    check(spec.init in INITS, f"{prefix}.init", f"must be one of {', '.join(INITS)}, got {spec.init!r}")


@dataclass
class AttnSpec(LayerSpec):
    """``attn``: one pass of attention + MLP. Block switches (fpscale.layers.switches), defaults
    fpscale's: ``mlp`` swiglu | relu2 (proj(0.5 relu(fc x)^2), jacobfa/Attractor's), ``qk_norm``
    (a parameter-free RMSNorm on q and k after RoPE), ``init`` fpscale | scaled_zero_ortho
    (Attractor's backbone init: orthogonal q/k/v/fc at std sqrt(2/(5d)), zero output projections)."""

    type: str = "attn"
    inits: ClassVar[tuple[str, ...]] = ("fpscale", "scaled_zero_ortho")     # Attractor's: fpscale.layers.switches
    mlp: str = "swiglu"
    qk_norm: bool = False
    init: str = "fpscale"
    value_embed: bool = False

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_switches(self, prefix)

    def validate_in(self, cfg, prefix: str) -> None:
        check(not self.value_embed or cfg.d_model >= VE_GATE_CHANNELS, f"{prefix}.value_embed",
              f"the gate reads the first {VE_GATE_CHANNELS} channels: d_model must be >= {VE_GATE_CHANNELS}, "
              f"got {cfg.d_model}")

    def build(self, cfg, solver=None) -> torch.nn.Module:
        return AttnBlock(cfg, self)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        hidden = swiglu_hidden(cfg.d_model, cfg.mlp_ratio)
        gate = 2 * VE_GATE_CHANNELS * cfg.n_heads if self.value_embed else 0
        return attention_flops(cfg.d_model, seq_len) + mlp_flops(cfg.d_model, hidden, self.mlp) + gate, 0.0


class Attention(torch.nn.Module):
    """Causal self-attention with RoPE and an optional KV cache for decoding."""

    def __init__(self, d_model: int, n_heads: int, rope_theta: float, init_std: float, out_std: float,
                 dropout: float = 0.0, qk_norm: bool = False, value_embed: int = 0):
        super().__init__()
        self.head_dim = d_model // n_heads
        # value_embed: the vocabulary size of a value-embedding table (0: none)
        self.value_embed = ValueEmbedding(value_embed, d_model, n_heads) if value_embed else None
        self.rope_theta, self.dropout, self.qk_norm = rope_theta, dropout, qk_norm
        self.token_capacity = 0          # the decoding cache's preallocated tokens (LoopedLM: model.max_seq_len)
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
        static = is_static(cache)
        keys = attention_keys(cache, static and "k" in cache, pad, pos, h.shape[1], self.token_capacity, h.device)
        h = self.shards.enter(h)
        extra = self.value_embed(h) if self.value_embed is not None else None
        with self.shards.rng():         # attention dropout: a mask per head, so per TP shard
            out, k, v = self_attention(h, self.w_qkv, self.w_o, self.head_dim, cos, sin, cache,
                                       self.dropout if self.training else 0.0, keys, self.qk_norm, extra)
        if cache is not None:       # preallocated for model.max_seq_len: no copy of the past per token
            if "k" in cache:
                for name in "kv":
                    cache[name].advance(h.shape[1])
            else:
                cache["k"], cache["v"] = (TokenBuffer(t, 2, self.token_capacity, static) for t in (k, v))
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
        kind = getattr(spec, "mlp", "swiglu")
        self.mlp = (Relu2MLP if kind == "relu2" else MLP)(cfg.d_model, cfg.mlp_ratio, cfg.init_std, out_std)
        if getattr(spec, "init", "fpscale") == "scaled_zero_ortho":     # Attractor's backbone init
            with torch.no_grad():
                scaled_zero_ortho_(self.attn.w_qkv, parts=3)
                self.attn.w_o.zero_()
                scaled_zero_ortho_(self.mlp.w_fc if kind == "relu2" else self.mlp.w_gate)
                if kind == "swiglu":
                    scaled_zero_ortho_(self.mlp.w_up)
                (self.mlp.w_proj if kind == "relu2" else self.mlp.w_down).zero_()
        self.dropout = cfg.dropout
        self.checkpoint = layer_mode(cfg, spec)

    def compile_regions(self) -> tuple[str, ...]:
        """What ``train.compile: blocks`` compiles (fpscale.parallel.compile): the whole block, or,
        where the attention is a solve, the MLP sublayer after it."""
        return ("mlp_sublayer",) if self.looped_attention else ("forward",)

    def make_attention(self, cfg, spec, solver, out_std: float) -> torch.nn.Module:
        return Attention(cfg.d_model, cfg.n_heads, cfg.rope_theta, cfg.init_std, out_std, cfg.attn_dropout,
                         getattr(spec, "qk_norm", False), cfg.vocab_size if getattr(spec, "value_embed", False) else 0)

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
