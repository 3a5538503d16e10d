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

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from fpscale.errors import check
from fpscale.layers.checkpointing import applies, layer_mode, recompute
from fpscale.layers.common import (
    MLP,
    RMSNorm,
    mlp_flops,
    mlp_tp_divisor,
    swiglu_hidden,
)
from fpscale.layers.fpmamba_map import FPMambaMixer, scan_flops
from fpscale.layers.mixers import kronecker_factors, mixer_flops
from fpscale.layers.registry import FixedPointSpec
from fpscale.typed import merge

# fpscale's value of each structural switch (a key left unset takes it, or its preset's value)
DEFAULTS = dict(negative_eigs=False, u_activation="none", out_norm="rmsnorm", bc_norm=True,
                input_path="conv_silu", gate="inside", y_into_delta=True, feedback_init="zero",
                weight_norm=False, kronecker_norm="eigenvalue", mixer_bias_init=-2.0)
# The authors' solver (models/model_utils.py ``FixedPointOptimizer`` as models/fp_mamba_block.py
# lines 173-180 builds it: stepsize 0.99, decay 0.9 after 15 steps without a new best, thresh
# 0.1, outlier quantile 0.25, stop once every stepsize < 1e-3, the best residual so far tested,
# one backward step ``n_backwards`` 1). Its caps (100 in training, 1000 in evaluation) are the
# run's: set solver.forward.max_iter / eval_max_iter.
AUTHORS_SOLVER = {"forward": dict(damping=0.99, decay=0.9, patience=15, tol=0.1, stop_quantile=0.25, eta_min=1e-3),
                  "compat": dict(stop_residual="best"), "adjoint": dict(backward="jfb")}
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
      init            fpscale: N(0, init_std), GPT-2-scaled w_out | authors (the presets' value):
                      nn.Linear's U(+-1/sqrt(fan_in)) on the input, conv, x, dt and output
                      projections and the mixer's x-halves (``FPMambaMixer.init_authors``)
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
    init: str | None = None      # type: ignore[assignment]   (None: the preset's, else fpscale)

    inits: ClassVar[tuple[str, ...]] = ("fpscale", "authors")

    def __post_init__(self):
        """Resolve every unset switch from the preset, else fpscale's ``DEFAULTS``; the preset's
        solver constants go under this layer's solver overrides (the layer's own keys win)."""
        preset = PRESETS.get(self.preset, {})
        if self.init is None:
            self.init = "authors" if self.preset != "none" else "fpscale"
        for name, default in DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, preset.get(name, default))
        if self.preset != "none":
            self.solver = merge(AUTHORS_SOLVER, self.solver)

    @property
    def iterate_free(self) -> bool:
        """Whether f never reads its iterate y: no channel mixer (Q = I, so x~ = Q (u - y) + y = u)
        and no y feedback (B, C, Delta see u alone). The layer is then a plain Mamba block, f(0)
        is its exact fixed point, and it applies f once (``fpscale.solvers.solve.apply_once``)
        whatever ``max_iter`` and ``backward`` say: seed 002's Mamba baseline (configs/125m_mamba.yaml)."""
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

class FPMambaBlock(torch.nn.Module):
    """x + mixer(norm(x)); with ``mlp``, then x + MLP(norm(x)) (the MLP runs once, after the solve:
    what ``checkpoint: mlp`` or ``block`` recomputes in backward; the solve never runs again)."""

    mixer_class = FPMambaMixer           # fpscale.layers.fpmamba2 builds its own mixer in the same block

    def __init__(self, cfg, spec, solver):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = self.mixer_class(cfg.d_model, spec, solver, cfg.init_std, cfg.out_init_std(), cfg.norm_eps)
        if spec.init == "authors":           # (a type without it never validates init: authors)
            self.mixer.init_authors(n_layer=len(cfg.expanded_layers()))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if spec.mlp else None
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio, cfg.init_std, cfg.out_init_std()) if spec.mlp else None
        self.dropout = cfg.dropout
        self.checkpoint = layer_mode(cfg, spec)

    def compile_regions(self) -> tuple[str, ...]:
        """What ``train.compile: blocks`` compiles: the MLP sublayer after the solve, if any, and FP-Mamba's
        work around its solve: the input path before it (in-projection, causal conv, SiLU: ``mixer.inputs``)
        and the gate outside it (``mixer.gated_output``, where the gate is outside the loop), each fused by
        the compiler into a few kernels. FP-Mamba-2's mixer has neither method: its MLP alone."""
        regions = ("mlp_sublayer",) if self.mlp is not None else ()
        if hasattr(self.mixer, "inputs"):
            regions += ("mixer.inputs",)
        if hasattr(self.mixer, "gated_output") and getattr(self.mixer, "gate", "inside") != "inside":
            regions += ("mixer.gated_output",)
        return regions

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
