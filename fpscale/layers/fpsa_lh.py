"""``fpsa_lh``: FPSA with a learned halting policy per token and head (seed 000, Sec. 4.5, App. F.1).

The FPSA map of ``halting: head`` (fpscale.layers.fpsa: the heads' outputs U, Z = U W_O, queries and
keys from N(h + Z)) is applied at most ``max_steps`` times, unrolled, with ACT halting per (token,
head) instead of a tolerance. At step k, for head i and token t (App. F.1, Eq. (20)):

    phi_k^(i)(t) = [m_k^(i)(t), dz_k^(i)(t), H(A_k^(i)(t, .))]
    lambda_k^(i)(t) = sigmoid(g_phi^(i)(phi))           g: a 2-layer MLP (3 -> gate_hidden -> 1) per head
    p_k = min(lambda_k, r_k),  r_{k+1} = r_k - p_k       (fpscale.layers.halting.Halting: ACT with
                                                          threshold 1 - 1e-6; the remainder goes to the
                                                          halting step, so sum_k p_k = 1 exactly)
    U_out = sum_k p_k U_k ;   a halted (token, head) is frozen (the selective update)
    ponder cost rho = N + R  (ACT: N the halting step, R = p_N), averaged over real (token, head)
    pairs; the loss gains ponder_cost * rho in training

    m      fpscale deviates here: the paper's m_k(t) is "the logit margin from the task head", a
           vocabulary-sized product per step and head in an LM. fpscale uses the head's own
           attention-logit margin (largest minus second largest score of the row), which reads only
           tokens <= t
    dz     ||U_k - U_{k-1}|| / (||U_k|| + eps) of the pair's d_h-vector (U_0 = 0)
    H      the entropy of the pair's attention row
The features are detached (the gate learns from the output weighting and the ponder cost; the paper
does not say). Attention is computed explicitly (the entropy and margin need the probabilities).
Under TP the heads and their gates split over ranks; the loop stops when no pair runs on any rank.
Decoding caches every step's keys of past tokens (a halted token's keys stop changing one step after
its last head halted, so steps past the cache read its last entry).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fpscale.errors import check
from fpscale.layers.attn import heads_and_mlp
from fpscale.layers.common import (
    TPSplit,
    attention_score_flops,
    mlp_flops,
    real_tokens,
    rope_span,
    split_heads,
    swiglu_hidden,
    wide,
)
from fpscale.layers.fpsa import FPSABlock, FPSAttention, token_major
from fpscale.layers.halting import Halting, HaltingStats
from fpscale.layers.looping import LoopedLayer
from fpscale.layers.registry import LayerSpec


@dataclass
class FPSALHSpec(LayerSpec):
    """``fpsa_lh``: at most max_steps FPSA iterations with a learned per-(token, head) ACT gate;
    ponder_cost weighs the expected number of steps in the loss; gate_hidden is the gate MLP's width."""

    type: str = "fpsa_lh"
    max_steps: int = 8
    ponder_cost: float = 0.01
    gate_hidden: int = 16
    spectral_norm: bool = True
    temperature: bool = True

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        for name in ("max_steps", "gate_hidden"):
            check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(math.isfinite(self.ponder_cost) and self.ponder_cost >= 0, f"{prefix}.ponder_cost",
              f"must be a finite number >= 0, got {self.ponder_cost}")

    def build(self, cfg, solver=None) -> torch.nn.Module:
        return FPSALHBlock(cfg, self)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model
        static = 2 * d * d + mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio))
        return static, 2 * 3 * d * d + attention_score_flops(d, seq_len) + 2 * cfg.n_heads * 4 * self.gate_hidden


class FPSALHAttention(LoopedLayer):
    """The learned-halting loop over FPSA's map (its projections are FPSAttention's)."""

    qk_weights = FPSAttention.qk_weights
    qk_weight = FPSAttention.qk_weight
    queries_and_keys = FPSAttention.queries_and_keys
    project = FPSAttention.project

    def __init__(self, cfg, spec: FPSALHSpec, out_std: float):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        # the FPSA weights, initialised as fpsa's (a throwaway FPSAttention gives the same draws)
        fpsa = FPSAttention(d, H, cfg.rope_theta, cfg.init_std, out_std, None, spectral_norm=spec.spectral_norm,
                            temperature=spec.temperature, norm_eps=cfg.norm_eps)
        self.spec, self.norm_eps, self.head_dim, self.rope_theta = spec, cfg.norm_eps, fpsa.head_dim, cfg.rope_theta
        self.spectral_norm, self.power_iters = fpsa.spectral_norm, fpsa.power_iters
        for name in ("w_q", "w_k", "w_v", "w_o", "log_temp"):
            setattr(self, name, getattr(fpsa, name))
        for name in ("u_q", "u_k"):
            self.register_buffer(name, getattr(fpsa, name))
        self._fpsa_plan = fpsa.tp_plan()
        n = spec.gate_hidden       # the gate g_phi per head: 3 -> n -> 1 (starts at lambda ~ sigmoid(-1))
        self.gate_w1 = torch.nn.Parameter(torch.randn(H, 3, n) / math.sqrt(3))
        self.gate_b1 = torch.nn.Parameter(torch.zeros(H, n))
        self.gate_w2 = torch.nn.Parameter(torch.zeros(H, n))
        self.gate_b2 = torch.nn.Parameter(torch.full((H,), -1.0))

    def tp_plan(self) -> dict[str, TPSplit]:
        return {**self._fpsa_plan, **{name: TPSplit(0) for name in ("gate_w1", "gate_b1", "gate_w2", "gate_b2")}}

    def gate(self, phi: torch.Tensor) -> torch.Tensor:
        """lambda [B, H, T] from the features [B, H, T, 3]."""
        w1, b1, w2, b2 = (p.to(phi.dtype) for p in (self.gate_w1, self.gate_b1, self.gate_w2, self.gate_b2))
        hidden = F.gelu(torch.einsum("bhtf,hfn->bhtn", phi, w1) + b1[:, None])
        return torch.sigmoid((hidden * w2[:, None]).sum(-1) + b2[:, None])

    def attend(self, q, k, v, scale, pos_q: int, pad) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal attention of q [B, H, T, dh] over k, v [B, H, Tk, dh] (queries at the end): the
        output, and per row the logit margin and the entropy of its probabilities."""
        T, Tk = q.shape[2], k.shape[2]
        scores = wide(q) @ wide(k).transpose(-1, -2) * scale
        i = torch.arange(Tk - T, Tk, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None]
        allowed = (j <= i)[None, None]
        if pad is not None:      # left padding hidden from every query (a padded query sees itself)
            allowed = allowed & ((j[None, None] >= pad.view(-1, 1, 1, 1)) | (j == i)[None, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, -1)
        top = scores.topk(min(2, Tk), -1).values
        margin = (top[..., 0] - top[..., 1]).nan_to_num(0.0, posinf=0.0) if Tk > 1 else torch.zeros_like(top[..., 0])
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return (probs.to(v.dtype) @ v), margin, entropy

    def forward(self, h: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        steps = spec.max_steps if self.training or self.eval_depth is None else min(spec.max_steps, self.eval_depth)
        w_qk, scale = self.qk_weight()
        v = split_heads(F.linear(self.shards.enter(h), self.w_v), self.head_dim)
        past = cache.get("k_steps") if cache else None
        v_all = v if not cache or "v" not in cache else torch.cat([cache["v"], v], 2)
        cos, sin = (token_major(t) for t in rope_span(self.head_dim, pos, h.shape[1], self.rope_theta, h, pad))
        B, H, T, dh = v.shape
        dtype = wide(h).dtype
        u = h.new_zeros(B, H, T, dh, dtype=dtype)
        out = torch.zeros_like(u)
        halting = Halting((B, H, T), h.device, dtype)
        real = real_tokens(pad, pos, T)
        if real is not None:        # padding takes no step: it halted before the first
            halting.running &= real[:, None]
            halting.remainder = halting.remainder * real[:, None]
        keys = []
        for k in range(steps):
            z = self.project(u.transpose(1, 2).reshape(B, T * H, dh))
            q, key = self.queries_and_keys(z, h, w_qk, cos, sin)
            keys.append(key.detach())
            k_all = key if past is None else torch.cat([past[min(k, len(past) - 1)], key], 2)
            new_u, margin, entropy = self.attend(q, k_all, v_all, scale, pos, pad)
            new_u = wide(new_u)
            with torch.no_grad():
                dz = (new_u - u).norm(dim=-1) / (new_u.norm(dim=-1) + 1e-6)
                phi = torch.stack([margin, dz, entropy], -1).to(dtype)
            u = torch.where(halting.running[..., None], new_u, u)      # a halted pair stays put
            p = halting.step(self.gate(phi), last=k == steps - 1)
            out = out + p[..., None] * u
            if not halting.any_running(self.shards.consensus):
                break
        if cache is not None:
            with torch.no_grad():       # the keys one step after the last: what later steps read
                z = self.project(u.transpose(1, 2).reshape(B, T * H, dh))
                keys.append(self.queries_and_keys(z, h, w_qk, cos, sin)[1].detach())
            n = max(len(keys), len(past) if past else 0)
            cache["k_steps"] = [keys[min(i, len(keys) - 1)] if past is None else
                                torch.cat([past[min(i, len(past) - 1)], keys[min(i, len(keys) - 1)]], 2)
                                for i in range(n)]
            cache["v"] = v_all.detach()
        self.record(halting, steps, real)
        return self.project(out.transpose(1, 2).reshape(B, T * H, dh)).to(h.dtype)

    def ponder(self, halting: Halting, real: torch.Tensor | None) -> torch.Tensor:
        """ACT's ponder cost N + R per (token, head), averaged over the real pairs of every head (the
        heads of every TP rank: the local sums are completed over the group)."""
        probs = halting.distribution()                                    # [B, H, T, S]
        n = halting.halt_step.clamp_min(1)
        r = probs.gather(-1, (n - 1)[..., None])[..., 0]
        rho = n.to(probs.dtype) + r
        w = torch.ones_like(rho) if real is None else real[:, None].to(rho.dtype).expand_as(rho)
        total = self.shards.exit(torch.stack([(rho * w).sum(), w.sum()]))
        return total[0] / total[1].clamp_min(1)

    def record(self, halting: Halting, steps: int, real) -> None:
        probs = halting.distribution()
        rho = self.ponder(halting, real)
        self.last_stats = PonderStats(probs.shape[-1], steps, probs.detach().flatten(1, 2),
                                       halting.halt_step.flatten(1, 2), rho.detach())
        self.aux_loss = self.spec.ponder_cost * rho if self.training else None


class PonderStats(HaltingStats):
    """HaltingStats over (token, head) pairs (``distribution`` [B, H * T, steps]); its ``kl`` slot
    holds the ponder cost N + R, reported as ``ponder``."""

    def from_summary(self, values: list[float]) -> dict:
        out = super().from_summary(values)
        out["ponder"] = out.pop("kl")
        return out


class FPSALHBlock(FPSABlock):
    """The fpsa block with the learned-halting attention (the MLP outside the loop)."""

    def make_attention(self, cfg, spec, solver, out_std: float) -> torch.nn.Module:
        return FPSALHAttention(cfg, spec, out_std)
