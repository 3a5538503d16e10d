"""The stacked-block core that ``looped`` and ``attractor`` iterate: n pre-norm attention + MLP blocks whose
weights are stacked over the blocks (dim 0) and used functionally, so the whole solve runs inside the
layer's single forward (ZeRO-3 gathers them once, ENVIRONMENT.md). Under tensor parallelism each
block splits its heads and MLP units as ``attn`` does (``tp_plan``); the iterate stays whole on every rank.
Decoding keeps every block's keys and values of past tokens at every iteration (``decode``:
fpscale.layers.step_cache). The layers say how the blocks combine (looped.py: FPRM's a1/b1 mixing;
attractor.py: gated residuals) and build their map f; the map's closure stays in each layer's own code,
so each layer type has its own compiled chunk (fpscale.solvers.chunked).
"""
from __future__ import annotations

from typing import Callable

import torch

from fpscale.layers.common import TPSplit, init_linear, rms_norm, self_attention, swiglu, swiglu_hidden
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.switches import relu2


class StackedBlocks(FixedPointLayer):
    """A fixed-point layer over ``n`` stacked blocks (``stack``), the MLP ``kind`` swiglu or relu2."""

    def stack(self, cfg, n: int, kind: str = "swiglu", qk_norm: bool = False) -> tuple[list, list]:
        """Register the blocks' parameters (names and order as before the two layers shared them:
        checkpoints load unchanged); returns (input-side, output-side) MLP weights for the init."""
        d = cfg.d_model
        hidden = swiglu_hidden(d, cfg.mlp_ratio)
        self.blocks, self.head_dim, self.rope_theta, self.eps = n, d // cfg.n_heads, cfg.rope_theta, cfg.norm_eps
        self.kind, self.qk_norm = kind, qk_norm
        self.attn_norm = torch.nn.Parameter(torch.ones(n, d))
        self.w_qkv = torch.nn.Parameter(torch.empty(n, 3 * d, d))
        self.w_o = torch.nn.Parameter(torch.empty(n, d, d))
        self.mlp_norm = torch.nn.Parameter(torch.ones(n, d))
        if kind == "relu2":
            self.w_fc = torch.nn.Parameter(torch.empty(n, hidden, d))
            self.w_proj = torch.nn.Parameter(torch.empty(n, d, hidden))
            return [self.w_fc], [self.w_proj]
        self.w_gate = torch.nn.Parameter(torch.empty(n, hidden, d))
        self.w_up = torch.nn.Parameter(torch.empty(n, hidden, d))
        self.w_down = torch.nn.Parameter(torch.empty(n, d, hidden))
        return [self.w_gate, self.w_up], [self.w_down]

    def init_fpscale(self, cfg, ins: list, outs: list) -> None:
        """fpscale's init: inputs at ``init_std``, outputs scaled down over the 2n sublayers."""
        out_std = cfg.out_init_std(sublayers=2 * self.blocks)
        for w in (self.w_qkv, *ins):
            init_linear(w, cfg.init_std)
        for w in (self.w_o, *outs):
            init_linear(w, out_std)

    def tp_plan(self) -> dict[str, TPSplit]:
        """Per stacked block (dim 0): heads and MLP hidden units; norms (and the layer's scalars) stay whole."""
        plan = {"w_qkv": TPSplit(1, parts=3), "w_o": TPSplit(2)}
        if self.kind == "relu2":
            return {**plan, "w_fc": TPSplit(1), "w_proj": TPSplit(2)}
        return {**plan, "w_gate": TPSplit(1), "w_up": TPSplit(1), "w_down": TPSplit(2)}

    def attention(self, l: int, z, cos, sin, past: dict | None, pad=None):
        """Block l's pre-norm attention; under TP this shard's heads, their outputs summed: (out, k, v)."""
        h = self.shards.enter(rms_norm(z, self.attn_norm[l], self.eps))
        out, k, v = self_attention(h, self.w_qkv[l], self.w_o[l], self.head_dim, cos, sin, past, pad=pad,
                                   qk_norm=self.qk_norm)
        return self.shards.exit(out), k, v

    def mlp(self, l: int, z):
        """Block l's pre-norm MLP (this shard's hidden units, summed under TP)."""
        h = self.shards.enter(rms_norm(z, self.mlp_norm[l], self.eps))
        if self.kind == "relu2":
            return self.shards.exit(relu2(h, self.w_fc[l], self.w_proj[l]))
        return self.shards.exit(swiglu(h, self.w_gate[l], self.w_up[l], self.w_down[l]))

    def decode(self, f_of: Callable, z0: torch.Tensor, real, cache: dict,
               rows_of: Callable | None = None) -> torch.Tensor:
        """The solve of cached decoding: ``f_of(s, past, collect)`` is the map reading the past's K/V of
        every block at this iteration and appending its own (k, v) per block to ``collect``;
        ``rows_of(index)`` the same map over rows ``index`` of the per-row inputs (decoding's row
        compaction, fpscale.solvers.rows: it reads and records the cache through ``steps.rows(index)``)."""
        steps, new = self.step_cache(cache), z0.shape[1]

        def map_of(steps, f_of):
            def f(s):
                collected: list = []
                out = f_of(s, steps.past_kv(self.blocks), collected)
                steps.record_kv(collected)
                return out
            return f

        def rows(index):
            return map_of(steps.rows(index, new), rows_of(index))

        s = self.fixed_point(map_of(steps, f_of), z0, real, steps, rows=rows if rows_of is not None else None)
        steps.store_kv(cache, self.blocks)
        return s
