"""``looped``: an FPRM core (seed 004) of L pre-norm sublayers iterated as a whole.

    inside a pass:   z^l = a1 z^{l-1} + b1 f^l(z^{l-1}),  l = 1..L   (f^l: attention or MLP)
    between passes:  z_{i+1}^0 = a2 z_i^L + b2 x~      (x~ = x, plus a causal depthwise conv of x)
    b2 = 1 - a2 a1^L,   b1 = b2 (1 - a1) / (1 - a1^L)   (Theorem 1: bounded iterates)
The fixed-point map is one pass, F(s) = pass(a2 s + b2 x~), from s_0 = 0; a1, a2 are learnable in
(0, 1). The layer returns s* (prelude -> core -> coda: the coda reads the core's state).

Its parameters are stacked over the ``core_blocks`` blocks and used functionally (fpscale.layers.stacked,
shared with ``attractor``), so the whole solve runs inside this module's single forward (ZeRO-3 gathers
them once). Decoding caches every attention sublayer's K/V of past tokens at every iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fpscale.errors import check
from fpscale.layers.attn import heads_and_mlp
from fpscale.layers.common import attention_flops, causal_conv, mlp_flops, real_tokens, rope_span, swiglu_hidden, wide
from fpscale.layers.registry import FixedPointSpec
from fpscale.layers.stacked import StackedBlocks
from fpscale.layers.step_cache import attention_keys, rope_rows

CONV_WIDTH = 4          # the causal depthwise conv on the re-injected input (``conv: true``)


@dataclass
class LoopedCoreSpec(FixedPointSpec):
    """``looped``: core_blocks attention + MLP blocks (2 x core_blocks sublayers) iterated as a
    whole; a1_init, a2_init the initial residual scalings in (0, 1); conv a causal depthwise
    conv branch on the re-injected input."""

    type: str = "looped"
    core_blocks: int = 2
    a1_init: float = 0.5
    a2_init: float = 0.5
    conv: bool = False

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(self.core_blocks >= 1, f"{prefix}.core_blocks", f"must be >= 1, got {self.core_blocks}")
        for name in ("a1_init", "a2_init"):
            value = getattr(self, name)
            check(0.0 < value < 1.0, f"{prefix}.{name}", f"must lie in (0, 1), got {value}")

    def build(self, cfg, solver) -> torch.nn.Module:
        return LoopedCore(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model                   # the conv once, the whole core per iteration
        static = 2 * d * CONV_WIDTH if self.conv else 0.0
        return static, self.core_blocks * (attention_flops(d, seq_len) + mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio)))


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


class LoopedCore(StackedBlocks):
    def __init__(self, cfg, spec, solver):
        super().__init__(solver)
        ins, outs = self.stack(cfg, spec.core_blocks)
        self.init_fpscale(cfg, ins, outs)
        # shape [1]: DeepSpeed cannot broadcast a 0-dim parameter
        self.a1_logit = torch.nn.Parameter(torch.tensor([_logit(spec.a1_init)]))
        self.a2_logit = torch.nn.Parameter(torch.tensor([_logit(spec.a2_init)]))
        self.conv_w = torch.nn.Parameter(torch.zeros(cfg.d_model, 1, CONV_WIDTH)) if spec.conv else None

    def scalings(self) -> tuple[torch.Tensor, ...]:
        """(a1, b1, a2, b2) with L = 2 * core_blocks sublayers, in at least float32 (the residual
        mixing of the iterate is elementwise algebra: fpscale.solvers.precision)."""
        a1, a2 = torch.sigmoid(wide(self.a1_logit)), torch.sigmoid(wide(self.a2_logit))
        a1L = a1 ** (2 * self.blocks)
        b2 = 1 - a2 * a1L
        b1 = b2 * (1 - a1) / (1 - a1L)
        return a1, b1, a2, b2

    def one_pass(self, z, cos, sin, caches: list | None, collect: list | None = None, pad=None):
        """One pass of the core over the float32 iterate z; the sublayers compute in the weights'
        dtype (their norms return it), the residual mixing stays in float32."""
        a1, b1, _, _ = self.scalings()
        for l in range(self.blocks):
            out, k, v = self.attention(l, z, cos, sin, caches[l] if caches else None, pad)
            if collect is not None:
                collect.append((k, v))
            z = a1 * z + b1 * out
            z = a1 * z + b1 * self.mlp(l, z)
        return z

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        x_in, window = x, None
        real = real_tokens(pad, pos, x.shape[1])
        if self.conv_w is not None:
            conv, window = causal_conv(x, self.conv_w, None, cache.get("conv") if cache else None, real)
            x_in = x + conv
        cos, sin = rope_span(self.head_dim, pos, x.shape[1], self.rope_theta, x, pad)
        _, _, a2, b2 = self.scalings()
        inject = b2 * x_in
        if cache is None:
            one_pass = self.compiled(self.one_pass)
            s = self.fixed_point(lambda s: one_pass(a2 * s + inject, cos, sin, None, pad=pad), torch.zeros_like(x),
                                 real)
        else:       # every sublayer's K/V at every iteration (fpscale.layers.step_cache)
            def rows_of(index):      # the map over rows ``index`` (decoding's row compaction)
                inj, (cos_r, sin_r, pad_r) = inject.index_select(0, index), rope_rows(cos, sin, pad, index)
                return lambda s, past, collect: self.one_pass(a2 * s + inj, cos_r, sin_r, past, collect, pad_r)

            keys = attention_keys(cache, bool(cache.get("steps")), pad, pos, x.shape[1], self.token_capacity, x.device)
            s = self.decode(lambda s, past, collect: self.one_pass(a2 * s + inject, cos, sin, past, collect, keys),
                            torch.zeros_like(x), real, cache, rows_of)
            if window is not None:
                cache["conv"] = window.detach()
        return s.to(x.dtype)
