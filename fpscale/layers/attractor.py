"""``attractor``: jacobfa/Attractor's weight-tied head (arXiv 2605.12466; code at commit fcf045f), solved
to a fixed point with an implicit backward. ``attractor.py:N`` below is a line of their
attractor/models/attractor/attractor.py (not a file of fpscale's).

The layer reads c, the output of the layers before it (their backbone: ``attn`` layers with
``mlp: relu2``, ``qk_norm: true``, ``init: scaled_zero_ortho``), and returns y* of

    f(y) = c + R(y + c),   R(h) = head(h) - h,   y0 = c          (attractor.py:332-336, 355)

i.e. f(y) = head(y + c) - y, where head is ``head_blocks`` pre-norm attention + MLP blocks whose
sublayer outputs are gated per channel by gamma_max * sigmoid(raw) (attractor.py:172-183; raw starts
at logit(gate_init / gamma_max), clipped to [1e-6, 1 - 1e-6], attractor.py:158-163; no weight
decay). The fixed point satisfies head(y* + c) = y* + c. Their model then applies ``ln_f`` to y*
and the tied unembedding (attractor.py:429, 443): in fpscale that is the LM's final RMSNorm
(``model.norm_eps`` 1e-5 as theirs) and tied head, so an ``attractor`` layer is the last of the stack.

Their solver is fpscale's solver with settings (docs/attractor.md, "The solve"): ``anderson: 5,
anderson_variant: attractor, norm: sample_l2, decisions: sample, stop_quantile: 0, patience: 0,
min_iter, damping: beta`` and ``backward: neumann1`` (their ``onestep``) or ``implicit`` with
``mask_unconverged: false`` (their Anderson adjoint): what conversion from their checkpoints writes.
It mixes each sample's tokens with one set of Anderson coefficients, so before convergence a later
token moves earlier outputs; the recipes (configs/*_attractor.yaml) solve causally instead:
``decisions: token, norm: l2`` and fpscale's Anderson, one mixing per token. Their head runs in eval
mode during the solve (attractor.py:299-310); fpscale's maps have no dropout inside them either.

The head's parameters are stacked over its blocks and used functionally (fpscale.layers.stacked, shared
with ``looped``), so the whole solve runs inside this module's single forward (ZeRO-3 gathers them
once). Tensor parallelism splits heads and MLP units as ``attn`` does; c and y stay whole on every
rank. Decoding keeps every head block's keys and values of past tokens at every iteration (fpscale.layers.step_cache, as
``looped``): with the causal solve (``decisions: token``) cached decoding repeats the full forward's
iterates, converged or not. Attractor's own solve (``decisions: sample``, their Anderson) is not
causal before convergence (docs/attractor.md): cached decoding then equals the full forward only
where the solves converge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fpscale.errors import check
from fpscale.layers.attn import check_switches, heads_and_mlp
from fpscale.layers.common import attention_flops, mlp_flops, real_tokens, rope_span, swiglu_hidden, wide
from fpscale.layers.registry import FixedPointSpec
from fpscale.layers.stacked import StackedBlocks
from fpscale.layers.step_cache import attention_keys, rope_rows
from fpscale.layers.switches import scaled_zero_ortho, scaled_zero_ortho_, trunc_normal_3


@dataclass
class AttractorSpec(FixedPointSpec):
    """``attractor``: head_blocks weight-tied blocks (their ``n_fp_blocks``: 1 at 140M, 2 at 370M and
    770M), gates gamma_max * sigmoid(raw) with gamma_max * sigmoid(raw_0) = gate_init (their
    ``layer_scale_init``); mlp, qk_norm and init as ``attn``'s switches, Attractor's by default."""

    type: str = "attractor"
    inits: ClassVar[tuple[str, ...]] = ("fpscale", "scaled_zero_ortho")     # Attractor's: fpscale.layers.switches
    head_blocks: int = 1
    gate_init: float = 0.75
    gamma_max: float = 0.75
    mlp: str = "relu2"
    qk_norm: bool = True
    init: str = "scaled_zero_ortho"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_switches(self, prefix)
        check(self.head_blocks >= 1, f"{prefix}.head_blocks", f"must be >= 1, got {self.head_blocks}")
        check(self.gamma_max > 0, f"{prefix}.gamma_max", f"must be > 0, got {self.gamma_max}")
        check(0 < self.gate_init, f"{prefix}.gate_init",
              f"must be > 0 (the gates' initial value, below gamma_max = {self.gamma_max}), got {self.gate_init}")

    def build(self, cfg, solver) -> torch.nn.Module:
        return AttractorHead(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model                   # the whole head per application of f
        return 0.0, self.head_blocks * (attention_flops(d, seq_len)
                                        + mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio), self.mlp))


def gate_logit(gate_init: float, gamma_max: float) -> float:
    """raw with gamma_max * sigmoid(raw) = gate_init, the ratio clipped as attractor.py:160 does."""
    p = min(max(gate_init / gamma_max, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))


class AttractorHead(StackedBlocks):
    def __init__(self, cfg, spec, solver):
        super().__init__(solver)
        d, n = cfg.d_model, spec.head_blocks
        ins, outs = self.stack(cfg, n, spec.mlp, spec.qk_norm)
        self.gamma_max = float(spec.gamma_max)
        raw = gate_logit(spec.gate_init, spec.gamma_max)
        self.raw_gamma_attn = torch.nn.Parameter(torch.full((n, d), raw))
        self.raw_gamma_mlp = torch.nn.Parameter(torch.full((n, d), raw))
        for p in (self.raw_gamma_attn, self.raw_gamma_mlp):
            p._no_weight_decay = True          # attractor.py:164-165
        with torch.no_grad():
            if spec.init == "scaled_zero_ortho":      # attractor.py:139-152 over their scaled-zero table
                std = scaled_zero_ortho(d)
                scaled_zero_ortho_(self.w_qkv, parts=3)
                for w in ins:
                    scaled_zero_ortho_(w)
                for w in (self.w_o, *outs):
                    trunc_normal_3(w, std)
            else:
                self.init_fpscale(cfg, ins, outs)

    def gates(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.sigmoid(self.raw_gamma_attn[l]) * self.gamma_max,
                torch.sigmoid(self.raw_gamma_mlp[l]) * self.gamma_max)

    def head(self, h, cos, sin, caches: list | None, collect: list | None = None, pad=None):
        """The head's blocks on h (the state dtype); sublayers compute in the weights' dtype, the
        gated residual sums stay in the state dtype."""
        for l in range(self.blocks):
            gate_attn, gate_mlp = self.gates(l)
            out, k, v = self.attention(l, h, cos, sin, caches[l] if caches else None, pad)
            if collect is not None:
                collect.append((k, v))
            h = h + out * gate_attn
            h = h + self.mlp(l, h) * gate_mlp
        return h

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        real = real_tokens(pad, pos, x.shape[1])
        cos, sin = rope_span(self.head_dim, pos, x.shape[1], self.rope_theta, x, pad)
        c = wide(x)
        if cache is None:
            head = self.compiled(self.head)
            return self.fixed_point(lambda y: head(y + c, cos, sin, None, pad=pad) - y, c, real).to(x.dtype)
        # decoding: every head block's K/V at every iteration (fpscale.layers.step_cache), as ``looped``
        def rows_of(index):          # the map over rows ``index`` (decoding's row compaction)
            c_r, (cos_r, sin_r, pad_r) = c.index_select(0, index), rope_rows(cos, sin, pad, index)
            return lambda y, past, collect: self.head(y + c_r, cos_r, sin_r, past, collect, pad_r) - y

        keys = attention_keys(cache, bool(cache.get("steps")), pad, pos, x.shape[1], self.token_capacity, x.device)
        y = self.decode(lambda y, past, collect: self.head(y + c, cos, sin, past, collect, keys) - y, c, real, cache,
                        rows_of)
        return y.to(x.dtype)
