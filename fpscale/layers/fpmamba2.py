"""``fpmamba2``: FP-Mamba2 (seed 002 App. E.2), Mamba-2's SSD iterated to a fixed point in depth.

The authors ship it as ``FPMamba2`` (dr-faustus/fp-rnn, models/fp_mamba2_block.py); fpscale's is
its own code with their choices as defaults. With x the layer input (after the block's norm),
    z = x W_z,  u = x W_x,  [B_x; C_x] = x W_bc,  dt = softplus(x W_dt + b_dt)     (their in_proj
    order [z, x, B, C, dt], lines 125-126 and 352-356; ``input_path: conv_silu`` adds a causal conv
    + SiLU on u, B, C: their ``use_short_conv``, default False, lines 134-146 and 357-384)
and one application of f on the iterate y (y^0 = 0, y_s = y shifted one step in time):
    x~   = Q(u, y_s) (u - y) + y                         the channel mixers of fpmamba (mixers.py)
    B, C = normalize per group(B_x + W_B^y y_s), likewise C (lines 276-282, 296-297: always normalised)
    h_t[h] = exp(dt_t[h] A_h) h_{t-1}[h] + dt_t[h] x~_t[h] B_t[g(h)]^T      scalar decay per head
    y    = RMSNorm(SiLU(z) * (C^T h + D_h x~))           over all d_inner channels (lines 209, 322-323)
Delta (dt) sees the input alone (their ``_fixed_point_step`` adds y only to B and C). The layer
returns W_out y*, or with ``gate: both`` (their default ``glu_in_loop`` False, lines 247-249)
W_out (SiLU(z + W_zy y*_{t-1}) * y*): the gate acts inside the norm in the loop and once more
outside with its own y feedback, as their code does. (With ``glu_in_loop`` True their scan also
gates, line 306, before the norm gates again, line 323: a second SiLU(z) that fpscale does not copy;
``gate: inside`` is the single gate inside the norm.)

Defaults are the authors' FPMamba2 constructor's (lines 40-85): d_state 128, headdim 64, ngroups 1,
expand 2, A_h ~ U(1, 16) (``A_init_range``), the Kronecker mixer with rank 1, SiLU on the mixer's u,
doubled coefficients (mixer.py lines 61, 85, 178), weight-normed mixer and feedback projections
(lines 148-150) with nn.Linear's default init, row-normalised Kronecker factors, no conv. Their
solver (FixedPointOptimizer, lines 196-203) is the FP-Mamba one with an outlier quantile of 0.1;
fpscale's solver settings stay the config's (``solver``, or this layer's ``solver`` overrides).

The scan (fpscale.ops.ssd): the chunked SSD in PyTorch on CPU, the fused selective-scan kernels
(mamba-ssm or fpscale's Triton scan) on CUDA. Tensor parallelism splits heads (d_inner channels with
them); B and C are computed whole on every rank (their ngroups x d_state channels are few) and each
rank takes its heads' groups. Decoding keeps the conv windows, the converged state and the converged
y of the last token, as fpmamba.
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
    Unsharded,
    causal_conv,
    init_linear,
    linear,
    mlp_flops,
    mlp_tp_divisor,
    real_tokens,
    swiglu_hidden,
    wide,
)
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.fpmamba import FPMambaBlock
from fpscale.layers.fpmamba_map import add_mixer_params, scan_flops, shift_in, weight_normed
from fpscale.layers.mixers import apply_mixer, kronecker_factors, mixer_flops, mixer_static
from fpscale.layers.registry import FixedPointSpec
from fpscale.layers.step_cache import replace, take_rows
from fpscale.ops.ssd import ssd


@dataclass
class FPMamba2Spec(FixedPointSpec):
    """``fpmamba2``: FP-Mamba2, with the authors' values as defaults (module doc). Keys as fpmamba's
    where they mean the same: mixer (householder | dplr | kronecker | none; authors: kronecker),
    mixer_rank (1), negative_eigs (doubled ranges: true), u_activation (silu), kronecker_norm
    (rows), weight_norm (true), feedback_init (linear), mixer_bias_init (0.0), y_feedback (y_{t-1}
    into the mixer, B and C), input_path (linear | conv_silu), mlp (a SwiGLU sublayer after the
    mixer, outside the loop; false). Its own: d_state (128), headdim (64), ngroups (1: B and C shared
    by all heads), expand (2), d_conv (4, with conv_silu), a_init_min / a_init_max (A_h drawn from
    U(1, 16)), gate (both: inside the norm and outside with W_zy y*_{t-1} | inside)."""

    type: str = "fpmamba2"
    mixer: Literal["householder", "dplr", "kronecker", "none"] = "kronecker"
    mixer_rank: int = 1
    d_state: int = 128
    headdim: int = 64
    ngroups: int = 1
    expand: int = 2
    d_conv: int = 4
    a_init_min: float = 1.0
    a_init_max: float = 16.0
    y_feedback: bool = True
    mlp: bool = False
    input_path: Literal["conv_silu", "linear"] = "linear"
    gate: Literal["both", "inside"] = "both"
    negative_eigs: bool = True
    u_activation: Literal["none", "silu"] = "silu"
    kronecker_norm: Literal["eigenvalue", "rows"] = "rows"
    weight_norm: bool = True
    feedback_init: Literal["zero", "linear"] = "linear"
    mixer_bias_init: float = 0.0

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        for name in ("mixer_rank", "d_state", "headdim", "ngroups", "expand", "d_conv"):
            value = getattr(self, name)
            check(value >= 1, f"{prefix}.{name}", f"must be >= 1, got {value}")
        check(0 < self.a_init_min <= self.a_init_max, f"{prefix}.a_init_max",
              f"needs 0 < a_init_min <= a_init_max, got {self.a_init_min}, {self.a_init_max}")
        check(not (self.weight_norm and self.feedback_init == "zero" and self.y_feedback), f"{prefix}.weight_norm",
              "needs feedback_init: linear (a weight that starts at zero has no direction to normalise)")

    def validate_in(self, cfg, prefix: str) -> None:
        di = self.expand * cfg.d_model
        check(di % self.headdim == 0, f"{prefix}.headdim",
              f"must divide d_inner = expand x d_model = {di}, got {self.headdim}")
        heads = di // self.headdim
        check(heads % self.ngroups == 0, f"{prefix}.ngroups",
              f"must divide the number of heads d_inner / headdim = {heads}, got {self.ngroups}")
        if self.mixer == "kronecker":
            check(kronecker_factors(di)[0] > 1, f"{prefix}.mixer",
                  f"kronecker needs d_inner = {di} to factor as d1*d2 with d1 > 1")

    @property
    def iterate_free(self) -> bool:
        """f never reads y (no mixer, no feedback): a plain Mamba-2 block, applied once."""
        return self.mixer == "none" and not self.y_feedback

    def build(self, cfg, solver) -> torch.nn.Module:
        return FPMamba2Block(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        heads = self.expand * cfg.d_model // self.headdim
        return [(f"the heads (d_inner {self.expand * cfg.d_model} / headdim {self.headdim})", heads)] + (
            [mlp_tp_divisor(cfg)] if self.mlp else [])

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        """In-projections, conv, W_out, the mixer's x-halves and W_zy once per solve; the mixer's
        y-halves, the feedback into B and C and the scan per iteration (the scan counted as the
        recurrence the fused kernels run, ``scan_flops``)."""
        d, di, N, G = cfg.d_model, self.expand * cfg.d_model, self.d_state, self.ngroups
        heads = di // self.headdim
        mix_static, mix_iter = mixer_flops(self.mixer, self.mixer_rank, di, self.y_feedback, self.kronecker_norm)
        proj_in = 2 * d * (2 * di + 2 * G * N + heads)
        conv = 2 * (di + 2 * G * N) * self.d_conv if self.input_path == "conv_silu" else 0.0
        gate_y = 2 * di * di if self.gate == "both" and self.y_feedback else 0.0
        mlp = mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio)) if self.mlp else 0.0
        per_iter = mix_iter + (2 * di * 2 * G * N if self.y_feedback else 0.0) + scan_flops(di, N)
        return proj_in + conv + 2 * di * d + mix_static + gate_y + mlp, per_iter


class FPMamba2Mixer(FixedPointLayer):
    def __init__(self, d_model: int, spec: FPMamba2Spec, solver, init_std: float, out_std: float,
                 norm_eps: float = 1e-6):
        super().__init__(solver)
        di, N, G = spec.expand * d_model, spec.d_state, spec.ngroups
        self.d_inner, self.d_state, self.ngroups, self.headdim = di, N, G, spec.headdim
        self.nheads = di // spec.headdim
        self.mixer, self.negative_eigs, self.y_feedback = spec.mixer, spec.negative_eigs, spec.y_feedback
        self.u_activation, self.kronecker_norm = spec.u_activation, spec.kronecker_norm
        self.input_path, self.gate = spec.input_path, spec.gate
        self.norm_eps = norm_eps
        self.state_sharded = True                 # tensor parallelism splits y by heads (d_inner channels)
        self.reads_y = not spec.iterate_free
        self.iterate_free = spec.iterate_free
        self.w_z = torch.nn.Parameter(torch.empty(di, d_model))
        self.w_x = torch.nn.Parameter(torch.empty(di, d_model))
        self.w_bc = torch.nn.Parameter(torch.empty(2 * G * N, d_model))
        self.w_dt = torch.nn.Parameter(torch.empty(self.nheads, d_model))
        for w in (self.w_z, self.w_x, self.w_bc, self.w_dt):
            init_linear(w, init_std)
        conv = spec.input_path == "conv_silu"
        k = spec.d_conv
        self.conv_x = torch.nn.Parameter(torch.randn(di, 1, k) / k ** 0.5) if conv else None
        self.conv_x_b = torch.nn.Parameter(torch.zeros(di)) if conv else None
        self.conv_bc = torch.nn.Parameter(torch.randn(2 * G * N, 1, k) / k ** 0.5) if conv else None
        self.conv_bc_b = torch.nn.Parameter(torch.zeros(2 * G * N)) if conv else None

        def feedback(*shape):        # a projection of y: zero or nn.Linear's init (the authors')
            w = torch.zeros(*shape)
            if spec.feedback_init == "linear":
                w.uniform_(-shape[1] ** -0.5, shape[1] ** -0.5)
            return torch.nn.Parameter(w)

        self.y_proj = feedback(2 * G * N, di) if spec.y_feedback else None            # their bc_y_proj
        self.z_y_proj = feedback(di, di) if spec.gate == "both" and spec.y_feedback else None
        # Mamba-2's init (their lines 154-171): dt log-uniform in [1e-3, 1e-1] (floor 1e-4), A_h ~ U(1, 16)
        dt = torch.exp(torch.rand(self.nheads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = torch.nn.Parameter(torch.empty(self.nheads).uniform_(spec.a_init_min, spec.a_init_max).log())
        self.A_log._no_weight_decay = True
        self.D = torch.nn.Parameter(torch.ones(self.nheads))
        self.out_norm_w = torch.nn.Parameter(torch.ones(di))
        self.w_out = torch.nn.Parameter(torch.empty(d_model, di))
        init_linear(self.w_out, out_std)
        add_mixer_params(self, spec, di, init_std)

    def tp_plan(self) -> dict[str, TPSplit]:
        """By heads: z, u, dt rows and their conv, A, D, dt bias, the norm, W_zy rows; the y feedback
        and W_out by columns (partial sums); the mixer as fpmamba's. B and C (w_bc, their conv) stay
        whole: every rank computes all groups and keeps its heads' (``_heads_bc``)."""
        plan = {name: TPSplit(0) for name in ("w_z", "w_x", "w_dt", "conv_x", "conv_x_b", "dt_bias", "A_log", "D",
                                              "out_norm_w", "z_y_proj", "z_y_proj_g")
                if getattr(self, name, None) is not None}
        plan.update({name: TPSplit(1) for name in ("y_proj", "w_out") if getattr(self, name) is not None})
        if self.mixer in ("householder", "dplr"):
            for name, p in self.mixer_params().items():
                if name.startswith("mix_u_"):
                    plan[name] = TPSplit(0, parts=p.shape[0] // self.d_inner)
                elif name.startswith("mix_a_") and p.dim() == 2:
                    plan[name] = TPSplit(1)
        return plan

    def mixer_params(self) -> dict:
        return {n: p for n, p in self.named_parameters(recurse=False) if n.startswith("mix_")}

    def weights(self) -> dict[str, torch.Tensor]:
        """The mixer's and feedback weights as f uses them (weight-normed: fpmamba_map.weight_normed)."""
        out = dict(self.mixer_params())
        out.update(y_proj=self.y_proj, z_y_proj=self.z_y_proj)
        return weight_normed(self, out, self.wn_groups)

    def _rms(self, t: torch.Tensor) -> torch.Tensor:
        t = wide(t)
        ms = self.shards.total(t.pow(2).sum(-1, keepdim=True)) / self.d_inner
        return t * torch.rsqrt(ms + self.norm_eps) * self.out_norm_w

    def _heads_bc(self, bc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, 2 G N] (whole) -> B, C [B, T, G', N] normalised per group, G' the groups of this
        shard's heads: under TP every head gets its group's row (G' = local heads)."""
        Bsz, T = bc.shape[:2]
        Bm, Cm = (F.normalize(t.view(Bsz, T, self.ngroups, self.d_state), dim=-1) for t in bc.chunk(2, -1))
        if isinstance(self.shards, Unsharded):
            return Bm, Cm
        per_head = self.nheads // self.ngroups          # nheads: the whole layer's (set before the split)
        return tuple(self.shards.scatter(t.repeat_interleave(per_head, dim=2).transpose(2, 3)).transpose(2, 3)
                     for t in (Bm, Cm))

    def static(self, u: torch.Tensor) -> dict:
        w = self.weights()
        mix = {n: p for n, p in w.items() if n.startswith("mix_")}
        return {"weights": w, "mix_params": mix, "mixer": mixer_static(self.mixer, mix, u, self.shards)}

    def step(self, y, u, gate, bc, dt, y_prev_last=None, h0=None, return_state=False, static=None, real=None):
        """One application of f: y -> y_new (and the last scan state), y in float32."""
        static = self.static(u) if static is None else static
        y_s = shift_in(y, y_prev_last)
        if not self.reads_y:
            x_t = wide(u)
        else:
            x_t = apply_mixer(self.mixer, static["mix_params"], wide(u) - y, u, y_s if self.y_feedback else None,
                              self.negative_eigs, self.shards, static["mixer"], self.u_activation,
                              self.kronecker_norm) + y
        if self.y_proj is not None:      # partial sums over the shards' channels; B and C's use under TP
            # (``_heads_bc``: each shard scatters its heads) already brings every shard the whole gradient
            bc = bc + wide(self.shards.exit(linear(y_s, static["weights"]["y_proj"])))
        Bm, Cm = self._heads_bc(bc)
        if real is not None:
            x_t = x_t.masked_fill(~real[..., None], 0.0)
        Bsz, T, di = x_t.shape
        xh = x_t.view(Bsz, T, -1, self.headdim)
        y_scan, h_last = ssd(xh, dt, -wide(self.A_log).exp(), Bm, Cm, h0)
        y_out = (y_scan + self.D[:, None] * xh).reshape(Bsz, T, di)
        y_new = self._rms(gate * y_out)
        if real is not None:
            y_new = y_new.masked_fill(~real[..., None], 0.0)
        return (y_new, h_last) if return_state else y_new

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        real = real_tokens(pad, pos, x.shape[1])
        xin = self.shards.enter(x)
        z, u, bc = F.linear(xin, self.w_z), F.linear(xin, self.w_x), F.linear(x, self.w_bc)
        windows = {}
        if self.input_path == "conv_silu":
            u, windows["conv_x"] = causal_conv(u, self.conv_x, self.conv_x_b, cache.get("conv_x") if cache else None,
                                               real)
            bc, windows["conv_bc"] = causal_conv(bc, self.conv_bc, self.conv_bc_b,
                                                 cache.get("conv_bc") if cache else None, real)
            u, bc = F.silu(u), F.silu(bc)
        elif real is not None:
            u = u.masked_fill(~real[..., None], 0.0)
        dt = F.softplus(wide(F.linear(xin, self.w_dt)) + self.dt_bias)                # [B, T, heads]
        gate, bc = F.silu(wide(z)), wide(bc)
        y_prev = cache.get("y") if cache else None          # the previous token's output (gate: both)
        static = self.static(u)
        z0 = torch.zeros_like(u, dtype=wide(u).dtype)
        if cache is None:
            step = self.compiled(self.step)
            y = self.fixed_point(lambda yy: step(yy, u, gate, bc, dt, None, None, static=static, real=real), z0, real)
        else:       # per iteration: the iterate's last y and the scan state after it (fpscale.layers.step_cache)
            steps = self.step_cache(cache)

            def map_of(steps, u, gate, bc, dt, static, real):      # f over every row, or a restriction's
                def f(yy):
                    y_new, h_last = self.step(yy, u, gate, bc, dt, steps.past("y"), steps.past("h"),
                                              return_state=True, static=static, real=real)
                    steps.record(y=yy[:, -1], h=h_last)
                    return y_new
                return f

            def rows(index):        # f on rows ``index`` (decoding's row compaction), sliced once
                u_r, gate_r, bc_r, dt_r, real_r = (take_rows(t, index) for t in (u, gate, bc, dt, real))
                return map_of(steps.rows(index), u_r, gate_r, bc_r, dt_r, self.static(u_r), real_r)

            y = self.fixed_point(map_of(steps, u, gate, bc, dt, static, real), z0, real, steps, rows=rows)
            steps.store(cache, {"y": replace, "h": replace})
            cache.update(y=y[:, -1].detach(), **{k: w.detach() for k, w in windows.items()})
        if self.gate == "both":
            pre = wide(z)
            if self.z_y_proj is not None:
                whole = self.shards.enter(self.shards.gather(shift_in(y, y_prev)))
                pre = pre + wide(linear(whole, static["weights"]["z_y_proj"]))
            y = F.silu(pre) * y
        return self.shards.exit(linear(y, self.w_out))


class FPMamba2Block(FPMambaBlock):
    """x + FP-Mamba2 mixer(norm(x)); with ``mlp``, then x + MLP(norm(x)) (fpmamba's block)."""

    mixer_class = FPMamba2Mixer
