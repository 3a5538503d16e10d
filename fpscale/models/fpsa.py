"""``fpsa``: fixed-point self-attention (seed 000, decoder variant of its App. J).

    h = norm(x),  V = h W_V  (static),  Z_0 = h
    Z_{k+1} = concat_heads( softmax(Q_k K_k^T * tau_h / sqrt(d_h) + causal) V ) W_O,
              Q_k = rope(N(h + Z_k) W_Q~),  K_k = rope(N(h + Z_k) W_K~),  W~ = W / sigma_max(W)
    out = x + Z*,  then the MLP sublayer (outside the loop)

N is a parameter-free RMS normalisation per token, applied in every iteration: queries and
keys read the iterate through the block's residual stream, as the next layer would read x + Z.
This is fpscale's form of the normalisation step inside the loop of seed 000's Algorithm 2
(README, "Deviations from the seeds"). Read literally, Eq. (1) derives Q_k from Z_k, which lives
at W_O's output scale (init std 0.02/sqrt(2L)): the logits are ~1e-3 and at initialisation every
fixed point is the uniform causal average of V, whatever the input. Algorithm 2's Tanh on Z_{k+1}
leaves a small iterate small (still degenerate); normalising Z_k alone rescales it but divides
perturbations by rms(Z), which breaks the contraction where attention is diffuse. N(h + Z_k)
gives input-dependent attention at initialisation, stays contractive, and its first iteration
(Z_0 = h, N(2h) = N(h)) is the paper's.

The causal mask is applied in every iteration; converged tokens may be frozen (selective
update, ``solver.freeze_converged``); the backward is implicit by default. With a cache,
past tokens contribute their converged K and static V, and only new tokens are iterated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fpscale.models.attn import AttnBlock, heads_and_mlp
from fpscale.models.common import (
    TPSplit,
    apply_rope,
    attention_score_flops,
    causal_attention,
    init_linear,
    linear,
    merge_heads,
    mlp_flops,
    real_tokens,
    rms_norm,
    rope_span,
    spectral_normalize,
    split_heads,
    swiglu_hidden,
)
from fpscale.models.fixed_point import FixedPointLayer
from fpscale.models.registry import FixedPointSpec


@dataclass
class FPSASpec(FixedPointSpec):
    """``fpsa``: spectral_norm divides W_Q, W_K by their largest singular value (a power
    iteration per step); temperature learns a softmax temperature per head."""

    type: str = "fpsa"
    spectral_norm: bool = True
    temperature: bool = True

    def build(self, cfg, solver) -> torch.nn.Module:
        return FPSABlock(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model            # V and the MLP once; Q, K, scores / values and W_O per iteration
        static = 2 * d * d + mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio))
        return static, 2 * 3 * d * d + attention_score_flops(d, seq_len)


def token_major(table: torch.Tensor) -> torch.Tensor:
    """A rope table of ``rope_span`` ([T, dh/2], or [B, 1, T, dh/2] with padding) laid out to
    rotate [B, T, H, dh]: [T, 1, dh/2], or [B, T, 1, dh/2]."""
    return table.unsqueeze(-2) if table.dim() == 2 else table.transpose(1, 2)


class FPSAttention(FixedPointLayer):
    def __init__(self, d_model: int, n_heads: int, rope_theta: float, init_std: float, out_std: float,
                 solver, spectral_norm: bool = True, temperature: bool = True, power_iters: int = 1,
                 norm_eps: float = 1e-6):
        super().__init__(solver)
        self.norm_eps = norm_eps
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.spectral_norm, self.power_iters = spectral_norm, power_iters
        self.w_q = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_k = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_v = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_o = torch.nn.Parameter(torch.empty(d_model, d_model))
        for w in (self.w_q, self.w_k, self.w_v):
            init_linear(w, init_std)
        init_linear(self.w_o, out_std)
        self.log_temp = torch.nn.Parameter(torch.zeros(n_heads)) if temperature else None
        g = torch.Generator().manual_seed(0)
        self.register_buffer("u_q", F.normalize(torch.randn(d_model, generator=g), dim=0))
        self.register_buffer("u_k", F.normalize(torch.randn(d_model, generator=g), dim=0))

    def tp_plan(self) -> dict[str, TPSplit]:
        """Rows are heads (the power-iteration vectors u_q, u_k too); W_O by columns."""
        plan = {name: TPSplit(0) for name in ("w_q", "w_k", "w_v", "u_q", "u_k")}
        plan["w_o"] = TPSplit(1)
        if self.log_temp is not None:
            plan["log_temp"] = TPSplit(0)
        return plan

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_Q, W_K divided by their largest singular values (the power iteration advances once
        per optimizer step: ``advance_power_step``)."""
        if not self.spectral_norm:
            return self.w_q, self.w_k
        update = self.advance_power_step()
        total = self.shards.total
        return (spectral_normalize(self.w_q, self.u_q, self.power_iters, update, total),
                spectral_normalize(self.w_k, self.u_k, self.power_iters, update, total))

    def qk_weight(self) -> tuple[torch.Tensor, float]:
        """[W_Q~; W_K~] stacked, so each iteration projects queries and keys in one product, and
        the logit scale left to the attention. With ``temperature`` each head's tau_h / sqrt(d_h)
        multiplies its rows of W_Q~ here, once per forward, instead of q in every iteration
        (rope is linear, so rope(q) tau_h = rope(q tau_h)); the attention's own scale is then 1."""
        wq, wk = self.qk_weights()
        scale = self.head_dim ** -0.5
        if self.log_temp is not None:      # one temperature per (local) head
            rows = (self.log_temp.exp() * scale).repeat_interleave(self.head_dim)
            wq, scale = wq * rows[:, None].to(wq.dtype), 1.0
        return torch.cat([wq, wk]), scale

    def queries_and_keys(self, z, h, w_qk, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Q_k, K_k [B, H, T, dh] of the iterate z: the normalisation step N(h + z) (what Q and K
        see of the iterate), one product with [W_Q~; W_K~], rope on both at once. Rope rotates the
        product as it lies, [B, T, 2H, dh] (``cos``, ``sin`` from ``token_major``), and the heads
        are then a transposed view: the values of rope on the [B, 2H, T, dh] view, without writing
        its result across the strided layout (the block's training step: 0.98x on a CPU)."""
        zn = self.shards.enter(rms_norm(h + z, None, self.norm_eps))
        qk = linear(zn, w_qk)
        qk = apply_rope(qk.view(*qk.shape[:-1], -1, self.head_dim), cos, sin).transpose(1, 2)   # [B, 2H, T, dh]
        return qk.chunk(2, dim=1)

    def step(self, z, h, w_qk, v, cos, sin, scale: float, past_k=None, pad=None) -> torch.Tensor:
        """One application of f: Z_k -> Z_{k+1} (``v``: past and new values; ``past_k``: the
        cached keys of earlier tokens, or None)."""
        q, k = self.queries_and_keys(z, h, w_qk, cos, sin)
        k_all = k if past_k is None else torch.cat([past_k, k], 2)
        return self.shards.exit(F.linear(merge_heads(causal_attention(q, k_all, v, scale, pad=pad)), self.w_o))

    def forward(self, h: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        w_qk, scale = self.qk_weight()     # under TP: this rank's heads; z stays whole
        v = split_heads(F.linear(self.shards.enter(h), self.w_v), self.head_dim)
        past_k = cache.get("k") if cache is not None else None
        past_v = cache.get("v") if cache is not None else None
        v_all = v if past_v is None else torch.cat([past_v, v], 2)
        cos, sin = (token_major(t) for t in rope_span(self.head_dim, pos, h.shape[1], self.rope_theta, h, pad))
        step = self.compiled(self.step) if past_k is None else self.step     # decoding stays eager

        def f(z):
            return step(z, h, w_qk, v_all, cos, sin, scale, past_k, pad)

        z = self.fixed_point(f, h, real_tokens(pad, pos, h.shape[1]))
        if cache is not None:
            with torch.no_grad():
                k_new = self.queries_and_keys(z.detach(), h, w_qk, cos, sin)[1].contiguous()   # not a view of Q too
            cache["k"] = k_new if past_k is None else torch.cat([past_k, k_new], 2)
            cache["v"] = v_all.detach()
        return z.to(h.dtype)


class FPSABlock(AttnBlock):
    """The attn block with fixed-point self-attention; the MLP stays outside the loop (the part
    ``checkpoint: mlp`` or ``block`` recomputes: the solve is never run again in backward)."""

    looped_attention = True

    def make_attention(self, cfg, spec, solver, out_std: float) -> torch.nn.Module:
        return FPSAttention(cfg.d_model, cfg.n_heads, cfg.rope_theta, cfg.init_std, out_std, solver,
                            spectral_norm=spec.spectral_norm, temperature=spec.temperature, norm_eps=cfg.norm_eps)
