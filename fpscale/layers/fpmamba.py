"""``fpmamba``: the FP-Mamba mixer iterated in depth (seed 002, section 4 and App. C).

With u = SiLU(conv(x W_x)) the static input channels, G = SiLU(x W_g) the gate, and y the
previous iterate (y^0 = 0), one application of f is (fpscale's defaults)
    y_s     = y shifted one step in time (y_{t-1}, zero at t = 0)
    x~_t    = Q_t (u_t - y_t) + y_t                      Q_t: channel mixer (fpscale.layers.mixers)
    B_t, C_t = normalize(W_B^x u_t + W_B^y y_s),  likewise C
    Delta_t = softplus(W_dt (W_d^x u_t + W_d^y y_s) + b_dt),  lambda_t = exp(-Delta_t A)
    h_t     = lambda_t * h_{t-1} + (Delta_t x~_t) B_t^T   (fpscale.ops.scan_kernels: mamba-ssm, Triton or
    y_t     = RMSNorm( G_t * (C_t^T h_t + D x~_t) )       chunked PyTorch; h never stored whole)
and the layer returns x + W_out y*. Decoding keeps the conv window, the converged state h and
the converged y of the last token, and iterates only the new token.

Every structural choice where the paper, its authors' code (dr-faustus/fp-rnn,
models/fp_mamba_block.py ``FPMamba``) and fpscale differ is a key of ``FPMambaSpec`` (the table:
docs/layers.md, "FP-Mamba: paper, authors' code, fpscale"):
    input_path     conv_silu: u = SiLU(conv(x W_x)) | linear: u = x W_x (their ``use_short_conv``
                   False, lines 96-105 and 298: no conv, no activation)
    gate           inside: G inside the norm, in the loop | outside: y* = norm(C^T h + D x~) and
                   the layer returns W_out (SiLU(x W_g + W_zy y*_{t-1}) * y*) (their
                   ``glu_in_loop`` False, lines 108-109 and 205-207)
    out_norm       rmsnorm | layernorm (centred, with a bias: their ``out_norm``, line 186) | none
                   (plain Mamba-1: y = G * (C^T h + D x~), mamba_ssm's ``Mamba``)
    bc_norm        B, C L2-normalised or not (their ``bc_norm``, lines 253-255)
    y_into_delta   whether y_{t-1} reaches Delta (theirs: B and C only, lines 233-239; Delta from
                   x alone, line 320)
    feedback_init  zero: W^y of B, C, Delta (and W_zy) start at 0 | linear: nn.Linear's default
                   U(+-1/sqrt(d_inner)) (their ``bc_y_proj``, ``z_y_proj``, lines 107-109)
    weight_norm    W = g v / ||v|| per output row on the mixer's projections and the feedback
                   ones (theirs: ``nn.utils.parametrizations.weight_norm``, lines 107-109 and
                   models/mixer.py); the x- and y-halves of a mixer projection share one row
                   norm, as their one Linear of [x; y] does
    u_activation, kronecker_norm, negative_eigs, mixer_bias_init: the mixer's (fpscale.layers.mixers)
and the solver's ``stop_residual`` (fpscale.solvers.stop_rule). ``preset: authors_lm`` and
``preset: authors_state_tracking`` set them all to the authors' values (``PRESETS``).

Precision (fpscale.solvers.precision): y, x~, Delta, lambda, the scan and its state h stay in
float32 whatever the model's dtype (as mamba-ssm keeps its scan); the projections run in the
weights' dtype. x~ = Q(u - y) + y cancels most of y (|y| = 1 after the RMSNorm, |u| ~ 0.1), so
a bf16 u - y leaves a 5-50% error in x~ and the solve never settles below a residual of 0.1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fpscale.errors import check
from fpscale.layers.checkpointing import applies, layer_mode, recompute
from fpscale.layers.common import (
    MLP,
    RMSNorm,
    TPSplit,
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
from fpscale.layers.mixers import apply_mixer, kronecker_factors, make_mixer_params, mixer_flops, mixer_static
from fpscale.layers.registry import FixedPointSpec
from fpscale.ops.scan_kernels import scan


def scan_flops(d_inner: int, d_state: int) -> float:
    """The scan's update h = lambda h + (Delta x~) B^T (elementwise) and its read C^T h (a small
    product per position, ``scan_read_flops``), per token."""
    return 2 * 3 * d_inner * d_state + scan_read_flops(d_inner, d_state)


def scan_read_flops(d_inner: int, d_state: int) -> float:
    """The read y = C^T h per token: a [1, n] x [n, d_inner] product in the PyTorch scan."""
    return 2 * d_inner * d_state


# fpscale's value of each structural switch (a key left unset takes it, or its preset's value)
DEFAULTS = dict(negative_eigs=False, u_activation="none", out_norm="rmsnorm", bc_norm=True,
                input_path="conv_silu", gate="inside", y_into_delta=True, feedback_init="zero",
                weight_norm=False, kronecker_norm="eigenvalue", mixer_bias_init=-2.0)
# The authors' solver (models/model_utils.py ``FixedPointOptimizer`` as models/fp_mamba_block.py
# lines 173-180 builds it: stepsize 0.99, decay 0.9 after 15 steps without a new best, thresh
# 0.1, outlier quantile 0.25, stop once every stepsize < 1e-3, the best residual so far tested,
# one backward step ``n_backwards`` 1). Its caps (100 in training, 1000 in evaluation) are the
# run's: set solver.max_iter / eval_max_iter.
AUTHORS_SOLVER = dict(damping=0.99, decay=0.9, patience=15, tol=0.1, stop_quantile=0.25, eta_min=1e-3,
                      stop_residual="best", backward="jfb")
_AUTHORS_MIXER = dict(negative_eigs=True, u_activation="silu", out_norm="layernorm", y_into_delta=False,
                      feedback_init="linear", weight_norm=True, kronecker_norm="rows", mixer_bias_init=0.0)
PRESETS = {
    # plainLM/config/fpmamba.yaml through plainLM/construct.py: use_short_conv True,
    # glu_in_loop True, bc_norm False
    "authors_lm": dict(_AUTHORS_MIXER, bc_norm=False, input_path="conv_silu", gate="inside"),
    # word_problem_exp/construct.py: FPMamba's defaults (use_short_conv False, glu_in_loop False,
    # bc_norm True: models/fp_mamba_block.py lines 52-53, 63)
    "authors_state_tracking": dict(_AUTHORS_MIXER, bc_norm=True, input_path="linear", gate="outside"),
}


@dataclass
class FPMambaSpec(FixedPointSpec):
    """``fpmamba``: mixer (householder | dplr | kronecker | none) and mixer_rank; d_state, expand,
    d_conv; y_feedback (B, C, Q, and Delta with ``y_into_delta``, see y_{t-1} of the last
    iterate); mlp (a SwiGLU sublayer after the mixer, outside the fixed-point loop: mamba_ssm's
    Block with a GatedMLP; the authors' FineWeb model has none). The structural switches (None:
    fpscale's value in ``DEFAULTS``, or the preset's), with the authors' value (dr-faustus/fp-rnn)
    and fpscale's:
      preset          none | authors_lm (their FineWeb block) | authors_state_tracking (their word-
                      problem block): every switch below, and their solver constants
                      (``AUTHORS_SOLVER``) under this layer's ``solver`` (a key given there wins)
      negative_eigs   doubled coefficient ranges (Householder/Kronecker a in (0, 2), DPLR 2 per
                      term; authors: always) | false: the proven-contraction ranges (fpscale)
      u_activation    silu (authors, App. C.3) | none (fpscale): SiLU on the mixer's u_i before
                      normalising
      out_norm        layernorm (authors) | rmsnorm (fpscale; FP-Mamba2's choice) | none (Mamba-1)
      bc_norm         B, C L2-normalised: true (fpscale; authors' state tracking) | false
                      (authors' FineWeb model)
      input_path      conv_silu (fpscale; authors' FineWeb) | linear (authors' state tracking)
      gate            inside (fpscale; authors' FineWeb) | outside, with its own y feedback
                      (authors' state tracking)
      y_into_delta    true (fpscale; seed 002 Sec. 4.3) | false (authors; App. C.2)
      feedback_init   zero (fpscale) | linear (authors: nn.Linear's default init)
      weight_norm     false (fpscale) | true (authors)
      kronecker_norm  eigenvalue (fpscale: a bound on lambda_max, ||K|| <= 1) | rows (authors)
      mixer_bias_init the mixer coefficients' logit bias: -2.0 (fpscale) | 0.0 (authors)
    """

    type: str = "fpmamba"
    mixer: Literal["householder", "dplr", "kronecker", "none"] = "householder"
    mixer_rank: int = 2
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    y_feedback: bool = True
    mlp: bool = False
    preset: Literal["none", "authors_lm", "authors_state_tracking"] = "none"
    negative_eigs: bool | None = None
    u_activation: Literal["none", "silu"] | None = None
    out_norm: Literal["rmsnorm", "layernorm", "none"] | None = None
    bc_norm: bool | None = None
    input_path: Literal["conv_silu", "linear"] | None = None
    gate: Literal["inside", "outside"] | None = None
    y_into_delta: bool | None = None
    feedback_init: Literal["zero", "linear"] | None = None
    weight_norm: bool | None = None
    kronecker_norm: Literal["eigenvalue", "rows"] | None = None
    mixer_bias_init: float | None = None

    def __post_init__(self):
        """Resolve every unset switch from the preset, else fpscale's ``DEFAULTS``; the preset's
        solver constants go under this layer's solver overrides (the layer's own keys win)."""
        preset = PRESETS.get(self.preset, {})
        for name, default in DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, preset.get(name, default))
        if self.preset != "none":
            self.solver = {**AUTHORS_SOLVER, **self.solver}

    @property
    def iterate_free(self) -> bool:
        """Whether f never reads its iterate y: no channel mixer (Q = I, so x~ = Q (u - y) + y = u)
        and no y feedback (B, C, Delta see u alone). The layer is then a plain Mamba block, f(0)
        is its exact fixed point, and it applies f once (``fpscale.solvers.solve.apply_once``)
        whatever ``max_iter`` and ``backward`` say: seed 002's Mamba baseline (configs/125m_mamba)."""
        return self.mixer == "none" and not self.y_feedback

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        for name in ("mixer_rank", "d_state", "expand", "d_conv"):
            value = getattr(self, name)
            check(value >= 1, f"{prefix}.{name}", f"must be >= 1, got {value}")
        check(not (self.weight_norm and self.feedback_init == "zero" and self.y_feedback), f"{prefix}.weight_norm",
              "needs feedback_init: linear (a weight that starts at zero has no direction to normalise: "
              "g v / ||v|| would stay 0 with zero gradients)")
        check(self.preset not in PRESETS or self.mixer != "none", f"{prefix}.mixer",
              f"is 'none' with preset {self.preset!r}: the authors' blocks have a channel mixer")

    def validate_in(self, cfg, prefix: str) -> None:
        if self.mixer == "kronecker":
            d_inner = self.expand * cfg.d_model
            check(kronecker_factors(d_inner)[0] > 1, f"{prefix}.mixer",
                  f"kronecker needs d_inner = {d_inner} to factor as d1*d2 with d1 > 1")

    def build(self, cfg, solver) -> torch.nn.Module:
        return FPMambaBlock(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        split = [(f"d_inner (expand {self.expand} x d_model {cfg.d_model})", self.expand * cfg.d_model)]
        return split + ([mlp_tp_divisor(cfg)] if self.mlp else [])

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d, di, N = cfg.d_model, self.expand * cfg.d_model, self.d_state
        dt_rank = -(-d // 16)
        # the projections of u (mixer, x_proj) once per solve; those of y, dt_proj and the scan per iteration
        mix_static, mix_iter = mixer_flops(self.mixer, self.mixer_rank, di, self.y_feedback,
                                           self.kronecker_norm)
        proj = 2 * di * (dt_rank + 2 * N)
        y_proj = 2 * di * ((dt_rank if self.y_into_delta else 0) + 2 * N)
        per_iter = mix_iter + (y_proj if self.y_feedback else 0.0) + 2 * dt_rank * di + scan_flops(di, N)
        mlp = mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio)) if self.mlp else 0.0
        conv = 2 * di * self.d_conv if self.input_path == "conv_silu" else 0.0
        gate_y = 2 * di * di if self.gate == "outside" and self.y_feedback else 0.0    # W_zy y*_{t-1}, once
        return 2 * d * 2 * di + conv + 2 * di * d + mlp + mix_static + proj + gate_y, per_iter


def weight_norm_groups(mixer: str, y_proj: bool, z_y_proj: bool) -> dict[str, tuple[str, ...]]:
    """The weight-normed projections (``weight_norm``): gain name -> the weights that share its row
    norm. A mixer projection's x- and y-halves are one row of the authors' Linear of [x; y]."""
    groups: dict[str, tuple[str, ...]] = {}
    if mixer in ("householder", "dplr"):
        groups.update(mix_u_g=("mix_u_x", "mix_u_y"), mix_a_g=("mix_a_x", "mix_a_y"))
    elif mixer == "kronecker":
        groups.update(mix_k1_g=("mix_k1_x", "mix_k1_y"), mix_k2_g=("mix_k2_x", "mix_k2_y"),
                      mix_a_g=("mix_a_x", "mix_a_y"))
    if y_proj:
        groups["y_proj_g"] = ("y_proj",)
    if z_y_proj:
        groups["z_y_proj_g"] = ("z_y_proj",)
    return groups


def weight_normed(layer, weights: dict, groups: dict[str, tuple[str, ...]]) -> dict:
    """``weights`` with each group's members replaced by g v / ||v|| (g: the layer's parameter named
    by the group's key; ||v|| per output row over all members). A group split by columns under TP
    (``layer.tp_plan()``) sums its partial row norms over ``layer.shards`` (``FPMambaMixer.weights``)."""
    out = dict(weights)
    plan = layer.tp_plan() if groups else {}
    for gain, names in groups.items():
        present = [n for n in names if out.get(n) is not None]
        sq = sum(wide(out[n]).pow(2).sum(1) for n in present)
        by_columns = present[0] in plan and plan[present[0]].dim == 1
        if by_columns:
            sq = layer.shards.exit(sq)
        scale = wide(getattr(layer, gain)) * torch.rsqrt(sq.clamp_min(1e-24))
        if by_columns:
            scale = layer.shards.enter(scale)
        for n in present:
            out[n] = (scale[:, None] * wide(out[n])).to(out[n].dtype)
    return out


class FPMambaMixer(FixedPointLayer):
    def __init__(self, d_model: int, spec, solver, init_std: float, out_std: float, norm_eps: float = 1e-6):
        super().__init__(solver)
        di, N = spec.expand * d_model, spec.d_state
        self.d_inner, self.d_state, self.d_conv = di, N, spec.d_conv
        self.dt_rank = max(1, math.ceil(d_model / 16))
        self.mixer, self.negative_eigs, self.y_feedback = spec.mixer, spec.negative_eigs, spec.y_feedback
        self.u_activation, self.kronecker_norm = spec.u_activation, spec.kronecker_norm
        self.out_norm, self.bc_norm = spec.out_norm, spec.bc_norm
        self.input_path, self.gate = spec.input_path, spec.gate
        self.y_into_delta = spec.y_feedback and spec.y_into_delta
        self.weight_norm = spec.weight_norm
        self.norm_eps = norm_eps
        self.state_sharded = True                # tensor parallelism splits y by d_inner channels
        # a plain Mamba block: ``step`` never reads y (``reads_y``), so f(0) is z* and the solver
        # applies f once (``iterate_free``, which a test may turn off to run the iterating path)
        self.reads_y = not spec.iterate_free
        self.iterate_free = spec.iterate_free
        self.w_in = torch.nn.Parameter(torch.empty(2 * di, d_model))
        conv = spec.input_path == "conv_silu"
        self.conv_w = torch.nn.Parameter(torch.randn(di, 1, spec.d_conv) / spec.d_conv ** 0.5) if conv else None
        self.conv_b = torch.nn.Parameter(torch.zeros(di)) if conv else None
        self.x_proj = torch.nn.Parameter(torch.empty(self.dt_rank + 2 * N, di))

        def feedback(*shape):        # a projection of y: zero (fpscale) or nn.Linear's init (authors)
            w = torch.zeros(*shape)
            if spec.feedback_init == "linear":
                w.uniform_(-shape[1] ** -0.5, shape[1] ** -0.5)
            return torch.nn.Parameter(w)

        # y_{t-1} into [dt_low; B; C] (fpscale) or [B; C] (``y_into_delta`` false: the authors' bc_y_proj)
        self.y_proj = feedback((self.dt_rank if self.y_into_delta else 0) + 2 * N, di) if spec.y_feedback else None
        # the gate's own feedback W_zy y*_{t-1} when the gate sits outside the loop (their z_y_proj)
        self.z_y_proj = feedback(di, di) if spec.gate == "outside" and spec.y_feedback else None
        self.dt_proj = torch.nn.Parameter(torch.empty(di, self.dt_rank))
        # Mamba's init: dt in [1e-3, 1e-1] log-uniformly, A_n = n
        dt = torch.exp(torch.rand(di) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1))
        self.A_log._no_weight_decay = True       # as mamba_ssm: the decay rates are not shrunk towards 0
        self.D = torch.nn.Parameter(torch.ones(di))
        self.out_norm_w = torch.nn.Parameter(torch.ones(di)) if spec.out_norm != "none" else None
        self.out_norm_b = torch.nn.Parameter(torch.zeros(di)) if spec.out_norm == "layernorm" else None
        self.w_out = torch.nn.Parameter(torch.empty(d_model, di))
        for w in (self.w_in, self.x_proj):
            init_linear(w, init_std)
        init_linear(self.dt_proj, self.dt_rank ** -0.5)
        init_linear(self.w_out, out_std)
        for name, p in make_mixer_params(spec.mixer, di, spec.mixer_rank, spec.y_feedback, init_std,
                                         spec.mixer_bias_init, spec.feedback_init).items():
            self.register_parameter(name, p)
        # weight norm W = g v / ||v||: the stored weights are v, each group's gain g starts at ||v||
        self.wn_groups = (weight_norm_groups(spec.mixer, self.y_proj is not None, self.z_y_proj is not None)
                          if spec.weight_norm else {})
        for gain, names in self.wn_groups.items():
            sq = sum(getattr(self, n).detach().pow(2).sum(1) for n in names if getattr(self, n, None) is not None)
            self.register_parameter(gain, torch.nn.Parameter(sq.sqrt()))

    def tp_plan(self) -> dict[str, TPSplit]:
        """By d_inner channels: in-projection rows ([x; gate] channels), conv / dt / A / D / output
        norm per channel, x/y-projections and W_out by columns (partial sums); the Householder /
        DPLR u-vectors by rows of each u_i, their w . x by columns; the gate's y feedback W_zy by
        rows (it reads the gathered y). Kronecker factors mix every channel with every other: the
        mixer gathers, and its parameters stay whole. Weight-norm gains split with their rows
        (u_i, W_zy) or stay whole (those of column-split weights: their row norms are summed)."""
        plan = {"w_in": TPSplit(0, parts=2)}
        plan.update({name: TPSplit(0) for name in ("conv_w", "conv_b", "dt_proj", "dt_bias", "A_log", "D",
                                                    "out_norm_w", "out_norm_b", "z_y_proj", "z_y_proj_g")
                     if getattr(self, name, None) is not None})
        plan.update({name: TPSplit(1) for name in ("x_proj", "y_proj", "w_out") if getattr(self, name) is not None})
        if self.mixer in ("householder", "dplr"):
            for name, p in self.mixer_params().items():
                if name.startswith("mix_u_"):                      # [rank * di, di] (and its gain [rank * di])
                    plan[name] = TPSplit(0, parts=p.shape[0] // self.d_inner)
                elif name.startswith("mix_a_") and p.dim() == 2:   # [rank, di]: w . x summed over shards
                    plan[name] = TPSplit(1)
        return plan

    def mixer_params(self) -> dict:
        return {n: p for n, p in self.named_parameters(recurse=False) if n.startswith("mix_")}

    def weights(self) -> dict[str, torch.Tensor]:
        """The mixer's and the feedback projections' weights as f uses them: with ``weight_norm``,
        g v / ||v|| per output row (computed once per solve). A group whose weights are split by
        columns under TP (mix_a, y_proj) sums its partial row norms over the shards: the sum with
        ``exit`` (no backward reduction) and the scale with ``enter`` (its gradient, partial on each
        shard, summed), so g and every v get the whole model's gradient."""
        out = dict(self.mixer_params())
        out.update(y_proj=self.y_proj, z_y_proj=self.z_y_proj)
        return weight_normed(self, out, self.wn_groups)

    def _norm(self, t: torch.Tensor) -> torch.Tensor:
        """The output norm over all d_inner channels (summed over the shards under TP), in at least
        float32: RMSNorm (fpscale) or LayerNorm (``out_norm: layernorm``: centred, with a bias), or
        none (``out_norm: none``, Mamba-1)."""
        t = wide(t)
        if self.out_norm == "none":
            return t
        if self.out_norm == "layernorm":
            t = t - self.shards.total(t.sum(-1, keepdim=True)) / self.d_inner
        ms = self.shards.total(t.pow(2).sum(-1, keepdim=True)) / self.d_inner
        t = t * torch.rsqrt(ms + self.norm_eps) * self.out_norm_w
        return t + self.out_norm_b if self.out_norm_b is not None else t

    def static(self, u: torch.Tensor) -> dict:
        """What f computes from the static input u alone, once per solve: the (weight-normed)
        weights, the x-halves of the mixer's projections and u W_x (the iterations add their
        y-halves to the same numbers)."""
        w = self.weights()
        mix = {n: p for n, p in w.items() if n.startswith("mix_")}
        return {"weights": w, "mix_params": mix, "mixer": mixer_static(self.mixer, mix, u, self.shards),
                "x_proj": linear(u, self.x_proj)}

    def step(self, y, u, gate, y_prev_last=None, h0=None, return_state=False, static=None, real=None):
        """One application of f: y -> y_new (and the final scan state), y in float32.
        ``static``: ``self.static(u)``, computed once per solve (None: computed here). ``real``
        [B, T] (left padding): padded tokens feed nothing into the scan and their y stays 0.
        ``gate``: SiLU(x W_g) inside the loop, None with the gate outside."""
        static = self.static(u) if static is None else static
        y_s = shift_in(y, y_prev_last)
        y_c = y_s if self.y_feedback else None
        if not self.reads_y:         # Q = I: x~ = (u - y) + y is u, without the rounding of y in and out
            x_t = wide(u)
        else:
            x_t = apply_mixer(self.mixer, static["mix_params"], wide(u) - y, u, y_c, self.negative_eigs,
                              self.shards, static["mixer"], self.u_activation, self.kronecker_norm) + y
        proj = static["x_proj"]
        if self.y_proj is not None:
            fed = linear(y_s, static["weights"]["y_proj"])
            if not self.y_into_delta:        # y reaches B and C only
                fed = torch.cat([fed.new_zeros(*fed.shape[:-1], self.dt_rank), fed], -1)
            proj = proj + fed
        proj = wide(self.shards.total(proj))     # x_proj, y_proj are row-parallel under TP
        dt_low, Bm, Cm = proj.split([self.dt_rank, self.d_state, self.d_state], -1)
        if self.bc_norm:
            Bm, Cm = F.normalize(Bm, dim=-1), F.normalize(Cm, dim=-1)
        delta = F.softplus(wide(linear(dt_low, self.dt_proj)) + self.dt_bias)          # [B, T, di]
        # h_t = exp(-Delta_t A) h_{t-1} + Delta_t x~_t B_t^T, read by C_t: only y and the last state leave
        if real is not None:
            x_t = x_t.masked_fill(~real[..., None], 0.0)
        y_scan, h_last = scan(x_t, delta, -wide(self.A_log).exp(), Bm, Cm, h0)
        y_out = y_scan + self.D * x_t
        y_new = self._norm(gate * y_out if gate is not None else y_out)
        if real is not None:
            y_new = y_new.masked_fill(~real[..., None], 0.0)
        return (y_new, h_last) if return_state else y_new

    def inputs(self, x: torch.Tensor, cache: dict | None, real: torch.Tensor | None):
        """The static input u, the gate's pre-activation x W_g and the conv window to cache:
        u = SiLU(conv(x W_x)) (``input_path`` conv_silu) or x W_x (linear)."""
        xc, g = F.linear(self.shards.enter(x), self.w_in).chunk(2, dim=-1)   # this shard's channels
        if self.input_path == "linear":
            return (xc if real is None else xc.masked_fill(~real[..., None], 0.0)), g, None
        conv, window = causal_conv(xc, self.conv_w, self.conv_b, cache.get("conv") if cache else None, real)
        return F.silu(conv), g, window

    def gated_output(self, y: torch.Tensor, g: torch.Tensor, y_prev: torch.Tensor | None, weights: dict):
        """With the gate outside the loop: SiLU(x W_g + W_zy y*_{t-1}) * y* (the authors'
        ``FPMamba.forward``, models/fp_mamba_block.py lines 205-207). W_zy reads the whole y
        (gathered under TP) and writes this shard's gate channels."""
        pre = wide(g)
        if self.z_y_proj is not None:
            whole = self.shards.enter(self.shards.gather(shift_in(y, y_prev)))
            pre = pre + wide(linear(whole, weights["z_y_proj"]))
        return F.silu(pre) * y

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        real = real_tokens(pad, pos, x.shape[1])
        u, g, window = self.inputs(x, cache, real)
        gate = F.silu(g) if self.gate == "inside" else None
        y_prev = cache.get("y") if cache else None
        h0 = cache.get("h") if cache else None
        static = self.static(u)
        step = self.compiled(self.step)
        y = self.fixed_point(lambda yy: step(yy, u, gate, y_prev, h0, static=static, real=real), torch.zeros_like(u),
                             real)
        if cache is not None:
            with torch.no_grad():
                _, h_last = self.step(y.detach(), u, gate, y_prev, h0, return_state=True, static=static, real=real)
            cache.update(h=h_last, y=y[:, -1].detach())
            if window is not None:
                cache.update(conv=window.detach())
        out = y if self.gate == "inside" else self.gated_output(y, g, y_prev, static["weights"])
        return self.shards.exit(linear(out, self.w_out))


def shift_in(y: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """y shifted one step in time: y_{t-1}, with ``last`` (the y of the token before this chunk,
    decoding) or zero at t = 0."""
    first = torch.zeros_like(y[:, :1]) if last is None else last.unsqueeze(1).to(y.dtype)
    return torch.cat([first, y[:, :-1]], 1)


class FPMambaBlock(torch.nn.Module):
    """x + mixer(norm(x)); with ``mlp``, then x + MLP(norm(x)) (the MLP runs once, after the solve:
    what ``checkpoint: mlp`` or ``block`` recomputes in backward; the solve never runs again)."""

    mixer_class = FPMambaMixer           # fpscale.layers.fpmamba2 builds its own mixer in the same block

    def __init__(self, cfg, spec, solver):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = self.mixer_class(cfg.d_model, spec, solver, cfg.init_std, cfg.out_init_std(), cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if spec.mlp else None
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio, cfg.init_std, cfg.out_init_std()) if spec.mlp else None
        self.dropout = cfg.dropout
        self.checkpoint = layer_mode(cfg, spec)

    def mlp_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        x = x + F.dropout(self.mixer(self.norm(x), pos, cache, pad), self.dropout, self.training)
        if self.mlp is None:
            return x
        if self.checkpoint != "none" and applies(cache):
            return recompute(self.mlp_sublayer, (self.mlp,), x)
        return self.mlp_sublayer(x)
