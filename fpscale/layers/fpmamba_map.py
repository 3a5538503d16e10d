"""The map of ``fpmamba`` (fpscale/layers/fpmamba.py has the type: its spec, presets and block, and the
equations): ``FPMambaMixer`` (one application of f, the solve, cached decoding, tensor-parallel splits),
the weight norm of its projections, and the scan's FLOPs. fpmamba2's mixer reuses these pieces.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpscale.layers.common import (
    TPSplit,
    causal_conv,
    init_linear,
    linear,
    real_tokens,
    wide,
)
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.fpmamba_init import init_authors
from fpscale.layers.mixers import apply_mixer, make_mixer_params, mixer_static
from fpscale.layers.step_cache import replace, take_rows
from fpscale.ops.scan_kernels import scan


def scan_flops(d_inner: int, d_state: int) -> float:
    """The scan's update h = lambda h + (Delta x~) B^T (elementwise) and its read C^T h (a small
    product per position, ``scan_read_flops``), per token."""
    return 2 * 3 * d_inner * d_state + scan_read_flops(d_inner, d_state)


def scan_read_flops(d_inner: int, d_state: int) -> float:
    """The read y = C^T h per token: a [1, n] x [n, d_inner] product in the PyTorch scan."""
    return 2 * d_inner * d_state

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


def add_mixer_params(layer: torch.nn.Module, spec, di: int, init_std: float) -> None:
    """Register the state mixer's parameters (fpscale.layers.mixers) on ``layer`` and, with
    ``weight_norm``, one gain per group: W = g v / ||v||, the stored weights are v and each gain
    starts at ||v|| (``reset_gains``). FP-Mamba and FP-Mamba2 share it."""
    for name, p in make_mixer_params(spec.mixer, di, spec.mixer_rank, spec.y_feedback, init_std,
                                     spec.mixer_bias_init, spec.feedback_init).items():
        layer.register_parameter(name, p)
    layer.wn_groups = (weight_norm_groups(spec.mixer, layer.y_proj is not None, layer.z_y_proj is not None)
                       if spec.weight_norm else {})
    for gain in layer.wn_groups:
        layer.register_parameter(gain, torch.nn.Parameter(torch.empty(0)))
    reset_gains(layer)


def reset_gains(layer: torch.nn.Module) -> None:
    """Each weight-norm gain g = ||v|| of its group's rows: W = g v / ||v|| starts at v."""
    for gain, names in layer.wn_groups.items():
        sq = sum(getattr(layer, n).detach().pow(2).sum(1) for n in names if getattr(layer, n, None) is not None)
        getattr(layer, gain).data = sq.sqrt()


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
        add_mixer_params(self, spec, di, init_std)

    def reset_gains(self) -> None:
        """Each weight-norm gain g = ||v|| of its group's rows: W = g v / ||v|| starts at v."""
        reset_gains(self)

    def init_authors(self, n_layer: int) -> None:
        """``init: authors``: dr-faustus/fp-rnn's initialisation (fpscale.layers.fpmamba_init)."""
        init_authors(self, n_layer)

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
        y_prev = cache.get("y") if cache else None          # the previous token's output (the gate outside)
        static = self.static(u)
        if cache is None:
            step = self.compiled(self.step)
            y = self.fixed_point(lambda yy: step(yy, u, gate, None, None, static=static, real=real),
                                 torch.zeros_like(u), real)
        else:       # per iteration: the iterate's last y and the scan state after it (fpscale.layers.step_cache)
            steps = self.step_cache(cache)

            def map_of(steps, u, gate, static, real):      # f over every row, or a restriction's (``rows``)
                def f(yy):
                    y_new, h_last = self.step(yy, u, gate, steps.past("y"), steps.past("h"), return_state=True,
                                              static=static, real=real)
                    steps.record(y=yy[:, -1], h=h_last)
                    return y_new
                return f

            def rows(index):        # f on rows ``index`` (decoding's row compaction), sliced once
                u_r, gate_r, real_r = (take_rows(t, index) for t in (u, gate, real))
                return map_of(steps.rows(index), u_r, gate_r, self.static(u_r), real_r)

            y = self.fixed_point(map_of(steps, u, gate, static, real), torch.zeros_like(u), real, steps, rows=rows)
            steps.store(cache, {"y": replace, "h": replace})
            cache.update(y=y[:, -1].detach())
            if window is not None:
                cache.update(conv=window.detach())
        out = y if self.gate == "inside" else self.gated_output(y, g, y_prev, static["weights"])
        return self.shards.exit(linear(out, self.w_out))


def shift_in(y: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """y shifted one step in time: y_{t-1}, with ``last`` (the y of the token before this chunk,
    decoding) or zero at t = 0."""
    first = torch.zeros_like(y[:, :1]) if last is None else last.unsqueeze(1).to(y.dtype)
    return torch.cat([first, y[:, :-1]], 1)
