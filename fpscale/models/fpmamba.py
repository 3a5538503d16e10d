"""``fpmamba``: the FP-Mamba mixer iterated in depth (seed 002, section 4 and App. C).

With u = SiLU(conv(x W_x)) the static input channels, G = SiLU(x W_g) the gate, and y the
previous iterate (y^0 = 0), one application of f is
    y_s     = y shifted one step in time (y_{t-1}, zero at t = 0)
    x~_t    = Q_t (u_t - y_t) + y_t                      Q_t: channel mixer (fpscale.models.mixers)
    B_t, C_t = normalize(W_B^x u_t + W_B^y y_s),  likewise C
    Delta_t = softplus(W_dt (W_d^x u_t + W_d^y y_s) + b_dt),  lambda_t = exp(-Delta_t A)
    h_t     = lambda_t * h_{t-1} + (Delta_t x~_t) B_t^T   (fpscale.models.scan_kernels: mamba-ssm, Triton or
    y_t     = RMSNorm( G_t * (C_t^T h_t + D x~_t) )       chunked PyTorch; h never stored whole)
and the layer returns x + W_out y*. Decoding keeps the conv window, the converged state h and
the converged y of the last token, and iterates only the new token.

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
from fpscale.models.checkpointing import applies, layer_mode, recompute
from fpscale.models.common import (
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
from fpscale.models.fixed_point import FixedPointLayer
from fpscale.models.mixers import apply_mixer, kronecker_factors, make_mixer_params, mixer_flops, mixer_static
from fpscale.models.registry import FixedPointSpec
from fpscale.models.scan_kernels import scan


def scan_flops(d_inner: int, d_state: int) -> float:
    """The scan's update h = lambda h + (Delta x~) B^T (elementwise) and its read C^T h (a small
    product per position, ``scan_read_flops``), per token."""
    return 2 * 3 * d_inner * d_state + scan_read_flops(d_inner, d_state)


def scan_read_flops(d_inner: int, d_state: int) -> float:
    """The read y = C^T h per token: a [1, n] x [n, d_inner] product in the PyTorch scan."""
    return 2 * d_inner * d_state


@dataclass
class FPMambaSpec(FixedPointSpec):
    """``fpmamba``: mixer (householder | dplr | kronecker | none) and mixer_rank; negative_eigs
    (Householder a_i in (0, 2): negative eigenvalues, no contraction guarantee); d_state, expand,
    d_conv; y_feedback (B, C, Delta, Q see y_{t-1} of the last iterate); mlp (a SwiGLU sublayer
    after the mixer, outside the fixed-point loop: seed 002's FineWeb blocks, mamba_ssm's Block
    with a GatedMLP)."""

    type: str = "fpmamba"
    mixer: Literal["householder", "dplr", "kronecker", "none"] = "householder"
    mixer_rank: int = 2
    negative_eigs: bool = False
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    y_feedback: bool = True
    mlp: bool = False

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
        mix_static, mix_iter = mixer_flops(self.mixer, self.mixer_rank, di, self.y_feedback)
        proj = 2 * di * (dt_rank + 2 * N)
        per_iter = mix_iter + (proj if self.y_feedback else 0.0) + 2 * dt_rank * di + scan_flops(di, N)
        mlp = mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio)) if self.mlp else 0.0
        return 2 * d * 2 * di + 2 * di * self.d_conv + 2 * di * d + mlp + mix_static + proj, per_iter


class FPMambaMixer(FixedPointLayer):
    def __init__(self, d_model: int, spec, solver, init_std: float, out_std: float, norm_eps: float = 1e-6):
        super().__init__(solver)
        di, N = spec.expand * d_model, spec.d_state
        self.d_inner, self.d_state, self.d_conv = di, N, spec.d_conv
        self.dt_rank = max(1, math.ceil(d_model / 16))
        self.mixer, self.negative_eigs, self.y_feedback = spec.mixer, spec.negative_eigs, spec.y_feedback
        self.norm_eps = norm_eps
        self.state_sharded = True                # tensor parallelism splits y by d_inner channels
        # a plain Mamba block: ``step`` never reads y (``reads_y``), so f(0) is z* and the solver
        # applies f once (``iterate_free``, which a test may turn off to run the iterating path)
        self.reads_y = not spec.iterate_free
        self.iterate_free = spec.iterate_free
        self.w_in = torch.nn.Parameter(torch.empty(2 * di, d_model))
        self.conv_w = torch.nn.Parameter(torch.randn(di, 1, spec.d_conv) / spec.d_conv ** 0.5)
        self.conv_b = torch.nn.Parameter(torch.zeros(di))
        self.x_proj = torch.nn.Parameter(torch.empty(self.dt_rank + 2 * N, di))
        self.y_proj = torch.nn.Parameter(torch.zeros(self.dt_rank + 2 * N, di)) if spec.y_feedback else None
        self.dt_proj = torch.nn.Parameter(torch.empty(di, self.dt_rank))
        # Mamba's init: dt in [1e-3, 1e-1] log-uniformly, A_n = n
        dt = torch.exp(torch.rand(di) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1))
        self.A_log._no_weight_decay = True       # as mamba_ssm: the decay rates are not shrunk towards 0
        self.D = torch.nn.Parameter(torch.ones(di))
        self.out_norm_w = torch.nn.Parameter(torch.ones(di))
        self.w_out = torch.nn.Parameter(torch.empty(d_model, di))
        for w in (self.w_in, self.x_proj):
            init_linear(w, init_std)
        init_linear(self.dt_proj, self.dt_rank ** -0.5)
        init_linear(self.w_out, out_std)
        for name, p in make_mixer_params(spec.mixer, di, spec.mixer_rank, spec.y_feedback, init_std).items():
            self.register_parameter(name, p)

    def tp_plan(self) -> dict[str, TPSplit]:
        """By d_inner channels: in-projection rows ([x; gate] channels), conv / dt / A / D / output
        norm per channel, x/y-projections and W_out by columns (partial sums); the Householder /
        DPLR u-vectors by rows of each u_i, their w . x by columns. Kronecker factors mix every
        channel with every other: the mixer gathers, and its parameters stay whole."""
        plan = {"w_in": TPSplit(0, parts=2)}
        plan.update({name: TPSplit(0) for name in ("conv_w", "conv_b", "dt_proj", "dt_bias", "A_log", "D",
                                                    "out_norm_w")})
        plan.update({name: TPSplit(1) for name in ("x_proj", "y_proj", "w_out") if getattr(self, name) is not None})
        if self.mixer in ("householder", "dplr"):
            for name, p in self.mixer_params().items():
                if name.startswith("mix_u_"):                      # [rank * di, di]
                    plan[name] = TPSplit(0, parts=p.shape[0] // self.d_inner)
                elif name.startswith("mix_a_") and p.dim() == 2:   # [rank, di]: w . x summed over shards
                    plan[name] = TPSplit(1)
        return plan

    def mixer_params(self) -> dict:
        return {n: p for n, p in self.named_parameters(recurse=False) if n.startswith("mix_")}

    def _rms(self, t: torch.Tensor) -> torch.Tensor:
        """RMSNorm over all d_inner channels (summed over the shards under TP), in at least float32."""
        t = wide(t)
        ms = self.shards.total(t.pow(2).sum(-1, keepdim=True)) / self.d_inner
        return t * torch.rsqrt(ms + self.norm_eps) * self.out_norm_w

    def static(self, u: torch.Tensor) -> dict:
        """What f computes from the static input u alone, once per solve: the x-halves of the
        mixer's projections and u W_x (the iterations add their y-halves to the same numbers)."""
        return {"mixer": mixer_static(self.mixer, self.mixer_params(), u, self.shards),
                "x_proj": linear(u, self.x_proj)}

    def step(self, y, u, gate, y_prev_last=None, h0=None, return_state=False, static=None, real=None):
        """One application of f: y -> y_new (and the final scan state), y in float32.
        ``static``: ``self.static(u)``, computed once per solve (None: computed here). ``real``
        [B, T] (left padding): padded tokens feed nothing into the scan and their y stays 0."""
        static = self.static(u) if static is None else static
        y_s = torch.cat([torch.zeros_like(y[:, :1]) if y_prev_last is None else y_prev_last.unsqueeze(1),
                         y[:, :-1]], 1)
        y_c = y_s if self.y_feedback else None
        if not self.reads_y:         # Q = I: x~ = (u - y) + y is u, without the rounding of y in and out
            x_t = wide(u)
        else:
            x_t = apply_mixer(self.mixer, self.mixer_params(), wide(u) - y, u, y_c, self.negative_eigs,
                              self.shards, static["mixer"]) + y
        proj = static["x_proj"]
        if self.y_proj is not None:
            proj = proj + linear(y_s, self.y_proj)
        proj = wide(self.shards.total(proj))     # x_proj, y_proj are row-parallel under TP
        dt_low, Bm, Cm = proj.split([self.dt_rank, self.d_state, self.d_state], -1)
        Bm, Cm = F.normalize(Bm, dim=-1), F.normalize(Cm, dim=-1)
        delta = F.softplus(wide(linear(dt_low, self.dt_proj)) + self.dt_bias)          # [B, T, di]
        # h_t = exp(-Delta_t A) h_{t-1} + Delta_t x~_t B_t^T, read by C_t: only y and the last state leave
        if real is not None:
            x_t = x_t.masked_fill(~real[..., None], 0.0)
        y_scan, h_last = scan(x_t, delta, -wide(self.A_log).exp(), Bm, Cm, h0)
        y_new = self._rms(gate * (y_scan + self.D * x_t))
        if real is not None:
            y_new = y_new.masked_fill(~real[..., None], 0.0)
        return (y_new, h_last) if return_state else y_new

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        xc, g = F.linear(self.shards.enter(x), self.w_in).chunk(2, dim=-1)   # this shard's channels
        real = real_tokens(pad, pos, x.shape[1])
        conv, window = causal_conv(xc, self.conv_w, self.conv_b, cache.get("conv") if cache else None, real)
        u = F.silu(conv)
        gate = F.silu(g)
        y_prev = cache.get("y") if cache else None
        h0 = cache.get("h") if cache else None
        static = self.static(u)
        step = self.compiled(self.step)
        y = self.fixed_point(lambda yy: step(yy, u, gate, y_prev, h0, static=static, real=real), torch.zeros_like(u),
                             real)
        if cache is not None:
            with torch.no_grad():
                _, h_last = self.step(y.detach(), u, gate, y_prev, h0, return_state=True, static=static, real=real)
            cache.update(conv=window.detach(), h=h_last, y=y[:, -1].detach())
        return self.shards.exit(linear(y, self.w_out))


class FPMambaBlock(torch.nn.Module):
    """x + mixer(norm(x)); with ``mlp``, then x + MLP(norm(x)) (the MLP runs once, after the solve:
    what ``checkpoint: mlp`` or ``block`` recomputes in backward; the solve never runs again)."""

    def __init__(self, cfg, spec, solver):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = FPMambaMixer(cfg.d_model, spec, solver, cfg.init_std, cfg.out_init_std(), cfg.norm_eps)
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
