"""``epsilon``: one shared block applied up to L_max times, each token halting when it learns to
(seed 003, Epsilon; the authors' code: github.com/mescuwa/epsilon).

    block        h <- h + alpha_res * attend(CenterNorm(h)),  h <- h + alpha_res * FFN(CenterNorm(h))
                 CenterNorm(x) = sqrt(d/(d-1)) (x - mean x) * gamma + beta; FFN = W2 GELU(W1 x + b1) + b2
                 with W1, W2 divided by their largest singular values; attend = causal HQSA
                 (fpscale.layers.hqsa) or ordinary causal attention (``attention: causal``)
    halting      after step t, lambda_t = sigmoid(w_t . h_t + b_t) (one head per step), spent from
                 the token's remainder (fpscale.layers.halting); the layer returns sum_t p_t h_t
    losses       kl_weight * KL(P || geometric prior of mean target_halting_mean) (annealed by a
                 cosine from 1 to 0.1 over kl_anneal_steps, as the authors anneal it per epoch)
                 + entropy_weight * (- entropy of HQSA's key-to-bin assignment at step 1)

Adapted to causal language modelling (the paper classifies IMDB reviews with a bidirectional
encoder), and where fpscale departs from the seed:
  - HQSA sums bins over the prefix (i <= j), not the sequence: causal, and decodable from
    running sums. Queries and binned keys carry RoPE (the paper adds sinusoidal positions to the
    embedding; fpscale's LM has none); the bin assignment reads the unrotated key.
  - A halted token stops changing (the authors keep updating it and only freeze its output), so
    that cached decoding gives the full forward's result; its remainder goes to its own last step
    (theirs is a separate (L_max+1)-th category), and the prior's tail is folded into step L_max.
  - The FFN's power iteration advances once per optimizer step (theirs once per block call):
    the same on every parallel layout. Q/K/V/O have no biases, like every fpscale attention.
  - The loop ends when every token of the batch has halted, agreed over the TP ranks.
The halting heads start at bias 0 (lambda = 0.5): the KL term, not the initialisation, sets the depth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fpscale.errors import check
from fpscale.layers.common import (
    TPSplit,
    apply_rope,
    attention_flops,
    causal_attention,
    init_linear,
    linear,
    merge_heads,
    real_tokens,
    rope_span,
    spectral_normalize,
    split_heads,
    wide,
)
from fpscale.layers.halting import Halting, HaltingStats, geometric_prior, halting_kl
from fpscale.layers.hqsa import assignment_entropy, bin_assignment, causal_hqsa, hqsa_flops
from fpscale.layers.looping import LoopedLayer
from fpscale.layers.registry import LayerSpec


@dataclass
class EpsilonSpec(LayerSpec):
    """``epsilon``: max_steps (L_max) applications of one block at most; attention ``hqsa`` (bins
    prototypes in a latent_dim space per head) or ``causal``; the FFN hidden size is
    ffn_ratio x d_model; alpha_res scales both residual branches. The halting prior has mean
    target_halting_mean in [1, max_steps]; kl_weight and entropy_weight weigh the two losses."""

    type: str = "epsilon"
    max_steps: int = 8
    attention: Literal["hqsa", "causal"] = "hqsa"
    bins: int = 16
    latent_dim: int = 8
    ffn_ratio: float = 4.0
    alpha_res: float = 0.25
    target_halting_mean: float = 3.0
    kl_weight: float = 0.015
    kl_anneal_steps: int = 0          # 0: no annealing
    entropy_weight: float = 0.005

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        for name in ("max_steps", "bins", "latent_dim"):
            value = getattr(self, name)
            check(value >= 1, f"{prefix}.{name}", f"must be >= 1, got {value}")
        check(self.ffn_ratio > 0, f"{prefix}.ffn_ratio", f"must be > 0, got {self.ffn_ratio}")
        check(0.0 < self.alpha_res <= 1.0, f"{prefix}.alpha_res", f"must lie in (0, 1], got {self.alpha_res}")
        check(1.0 <= self.target_halting_mean <= self.max_steps, f"{prefix}.target_halting_mean",
              f"must lie in [1, max_steps = {self.max_steps}], got {self.target_halting_mean}")
        for name in ("kl_weight", "entropy_weight", "kl_anneal_steps"):
            value = getattr(self, name)
            check(value >= 0, f"{prefix}.{name}", f"must be >= 0, got {value}")

    def hidden(self, cfg) -> int:
        return max(1, round(self.ffn_ratio * cfg.d_model))

    def build(self, cfg, solver=None) -> torch.nn.Module:
        return EpsilonLayer(cfg, self)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return [("model.n_heads", cfg.n_heads), ("the epsilon FFN hidden size", self.hidden(cfg))]

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model               # everything per step: the block and this step's halting head
        if self.attention == "causal":
            attend = attention_flops(d, seq_len)
        else:
            attend = 2 * 4 * d * d + hqsa_flops(d, cfg.n_heads, self.bins, self.latent_dim, seq_len)
        return 0.0, attend + 2 * 2 * d * self.hidden(cfg) + 2 * d

    def kl_scale(self, step: int | None) -> float:
        """The authors' annealing of the KL weight: a cosine from 1 to 0.1 over kl_anneal_steps."""
        if not self.kl_anneal_steps or step is None:
            return 1.0
        progress = min(step / self.kl_anneal_steps, 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def center_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """sqrt(d/(d-1)) (x - mean x), then the authors' affine; in at least float32, returned in the
    weights' dtype (the products it feeds)."""
    x = wide(x)
    d = x.shape[-1]
    out = (x - x.mean(-1, keepdim=True)) * math.sqrt(d / max(d - 1, 1))
    return (out * gamma + beta).to(gamma.dtype)


class EpsilonLayer(LoopedLayer):
    def __init__(self, cfg, spec: EpsilonSpec):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        hidden, L = spec.hidden(cfg), spec.max_steps
        self.spec, self.n_heads, self.head_dim, self.rope_theta = spec, H, d // H, cfg.rope_theta
        self.dropout, self.attn_dropout = cfg.dropout, cfg.attn_dropout
        # CenterNorm keeps the input's scale (gain 1: the contraction argument of the paper's A.1);
        # the block then works at the residual stream's scale, set by model.embed_scale
        self.norm1_w, self.norm1_b = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))
        self.norm2_w, self.norm2_b = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))
        self.w_qkv = torch.nn.Parameter(torch.empty(3 * d, d))
        self.w_o = torch.nn.Parameter(torch.empty(d, d))
        init_linear(self.w_qkv, cfg.init_std)
        init_linear(self.w_o, cfg.out_init_std())
        if spec.attention == "hqsa":
            self.w_bin = torch.nn.Parameter(torch.randn(spec.latent_dim, self.head_dim) / math.sqrt(self.head_dim))
            self.prototypes = torch.nn.Parameter(torch.randn(H, spec.bins, spec.latent_dim)
                                                 / math.sqrt(spec.latent_dim))
            self.log_tau = torch.nn.Parameter(torch.zeros(H))          # tau = 1 per head
        self.w_ffn1 = torch.nn.Parameter(torch.empty(hidden, d))
        self.b_ffn1 = torch.nn.Parameter(torch.zeros(hidden))
        self.w_ffn2 = torch.nn.Parameter(torch.empty(d, hidden))
        self.b_ffn2 = torch.nn.Parameter(torch.zeros(d))
        init_linear(self.w_ffn1, cfg.init_std)       # the scale is divided out by the spectral norm
        init_linear(self.w_ffn2, cfg.init_std)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("u_ffn1", F.normalize(torch.randn(hidden, generator=g), dim=0))
        self.register_buffer("u_ffn2", F.normalize(torch.randn(hidden, generator=g), dim=0))   # of W2^T
        self.w_halt = torch.nn.Parameter(torch.empty(L, d))       # one halting head per step
        self.b_halt = torch.nn.Parameter(torch.zeros(L))
        init_linear(self.w_halt, cfg.init_std)

    def tp_plan(self) -> dict[str, TPSplit]:
        """Heads (q/k/v rows, W_O columns, each head's prototypes and temperature) and FFN hidden
        units (W1 rows and b1, W2 columns, both power-iteration vectors). W_bin is shared by the
        heads: whole on every shard, its gradient summed over them (``enter``)."""
        plan = {"w_qkv": TPSplit(0, parts=3), "w_o": TPSplit(1), "w_ffn1": TPSplit(0), "b_ffn1": TPSplit(0),
                "w_ffn2": TPSplit(1), "u_ffn1": TPSplit(0), "u_ffn2": TPSplit(0)}
        if self.spec.attention == "hqsa":
            plan.update(prototypes=TPSplit(0), log_tau=TPSplit(0))
        return plan

    # -- the block ------------------------------------------------------------------------------
    def ffn_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W1 and W2 divided by their largest singular values (under TP, of the whole matrices)."""
        update = self.advance_power_step()
        total = self.shards.total
        w1 = spectral_normalize(self.w_ffn1, self.u_ffn1, 1, update, total)
        w2 = spectral_normalize(self.w_ffn2.t(), self.u_ffn2, 1, update, total).t()
        return w1, w2

    def attend(self, hn: torch.Tensor, cos, sin, past: dict | None, pad=None, real=None):
        """(this shard's heads' output summed over the shards, the cache entry covering past and
        new tokens, the bin assignment or None)."""
        x = self.shards.enter(hn)
        q, k, v = (split_heads(t, self.head_dim) for t in linear(x, self.w_qkv).chunk(3, dim=-1))
        p = self.attn_dropout if self.training else 0.0
        assign = None
        with self.shards.rng():           # dropout masks per head, so per TP shard
            if self.spec.attention == "causal":
                k = apply_rope(k, cos, sin)
                if past:
                    k, v = torch.cat([past["k"], k], 2), torch.cat([past["v"], v], 2)
                out, entry = causal_attention(apply_rope(q, cos, sin), k, v, dropout_p=p, pad=pad), {"k": k, "v": v}
            else:
                assign = bin_assignment(k, self.shards.enter(self.w_bin), self.prototypes, self.log_tau)
                if real is not None:      # padded keys join no bin
                    assign = assign.masked_fill(~real[:, None, :, None], 0.0)
                out, entry = causal_hqsa(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, assign, past, p)
        return self.shards.exit(linear(merge_heads(out.to(x.dtype)), self.w_o)), entry, assign

    def ffn(self, hn: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        u = F.gelu(linear(self.shards.enter(hn), w1, self.b_ffn1))
        with self.shards.rng():
            u = F.dropout(u, self.dropout, self.training)
        return self.shards.exit(linear(u, w2)) + self.b_ffn2

    def block(self, h: torch.Tensor, ffn_w, cos, sin, past: dict | None, pad=None, real=None):
        """One application to the float32 state h: (new h, cache entry, bin assignment)."""
        alpha = self.spec.alpha_res
        out, entry, assign = self.attend(center_norm(h, self.norm1_w, self.norm1_b), cos, sin, past, pad, real)
        h = h + alpha * F.dropout(out, self.dropout, self.training)
        out = self.ffn(center_norm(h, self.norm2_w, self.norm2_b), *ffn_w)
        return h + alpha * F.dropout(out, self.dropout, self.training), entry, assign

    # -- the loop -------------------------------------------------------------------------------
    def compile_regions(self) -> tuple[str, ...]:
        """What ``train.compile: blocks`` compiles (fpscale.parallel.compile): one step of the loop, the
        block and its halting head, one graph for every step (the step's head comes in as a tensor);
        the halting update (a few elementwise operations on the running sums, whose autograd status
        changes after the first step) and the host read between steps stay outside. Decoding (``past``
        given) runs it eager."""
        return ("halting_step",)

    def halting_step(self, h, running, w_t, b_t, ffn_w, cos, sin, pad, real, past: dict | None = None):
        """One application of the block, a halted token's state kept, and this step's halting
        probability: (h, lambda_t, cache entry, bin assignment)."""
        new_h, entry, assign = self.block(h, ffn_w, cos, sin, past, pad, real)
        h = torch.where(running[..., None], new_h, h)
        return h, torch.sigmoid(wide(linear(h, w_t, b_t)))[..., 0], entry, assign

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        steps = spec.max_steps if self.training or self.eval_depth is None else min(spec.max_steps, self.eval_depth)
        cos, sin = rope_span(self.head_dim, pos, x.shape[1], self.rope_theta, x, pad)
        real = real_tokens(pad, pos, x.shape[1])
        ffn_w = self.ffn_weights()
        past = cache.get("steps") if cache else None
        h = wide(x)
        halting = Halting(h.shape[:2], h.device, h.dtype)
        y = torch.zeros_like(h)
        entries, entropy = [], None
        for t in range(steps):
            h, lam, entry, assign = self.halting_step(h, halting.running, self.w_halt[t:t + 1], self.b_halt[t:t + 1],
                                                      ffn_w, cos, sin, pad, real, past=past[t] if past else None)
            entries.append(entry)
            if t == 0 and assign is not None:     # the authors' entropy term: the first step's bins
                entropy = self.shards.exit(assignment_entropy(assign) / self.n_heads)
            y = y + halting.step(lam, last=t == steps - 1)[..., None] * h
            if not halting.any_running(self.shards.consensus):
                break
        if cache is not None:
            cache["steps"] = self.cache_entries(entries, h, cos, sin, past, pad, real)
        self.record(halting, entropy, steps)
        return y.to(x.dtype)

    @torch.no_grad()
    def cache_entries(self, entries: list, h: torch.Tensor, cos, sin, past: list | None, pad=None,
                      real=None) -> list:
        """Every step's keys and values (or HQSA's running sums) of past and new tokens, for
        decoding. Steps the loop did not reach read the final, halted states."""
        out = [{key: t.detach() for key, t in e.items()} for e in entries]
        for t in range(len(entries), self.spec.max_steps):
            _, entry, _ = self.attend(center_norm(h, self.norm1_w, self.norm1_b), cos, sin, past[t] if past else None,
                                      pad, real)
            out.append({key: v.detach() for key, v in entry.items()})
        return out

    def record(self, halting: Halting, entropy: torch.Tensor | None, steps: int) -> None:
        """The halting statistics of this forward and, in training, the weighted auxiliary loss."""
        spec = self.spec
        probs = halting.distribution()
        kl = halting_kl(probs, geometric_prior(spec.target_halting_mean, spec.max_steps, probs.dtype,
                                               probs.device)).mean()
        self.last_stats = HaltingStats(probs.shape[-1], steps, probs.detach(), halting.halt_step, kl.detach(),
                                       None if entropy is None else entropy.detach())
        self.aux_loss = None
        if self.training:
            loss = spec.kl_weight * spec.kl_scale(self.optim_step) * kl
            if entropy is not None:
                loss = loss - spec.entropy_weight * entropy
            self.aux_loss = loss
