"""``fpsa``: fixed-point self-attention (seed 000, decoder variant of its App. J).

    h = norm(x),  V = h W_V  (static),  Z_0 = h
    Z_{k+1} = concat_heads( softmax(Q_k K_k^T * tau_h / sqrt(d_h) + causal) V ) W_O,
              Q_k = rope(N(h + Z_k) W_Q~),  K_k = rope(N(h + Z_k) W_K~),  W~ = W / sigma_max(W)
    out = x + Z*,  then the MLP sublayer (outside the loop)

N is a parameter-free RMS normalisation per token, applied in every iteration: queries and
keys read the iterate through the block's residual stream, as the next layer would read x + Z.
This is fpscale's form of the normalisation step inside the loop of seed 000's Algorithm 2
(docs/layers.md). Read literally, Eq. (1) derives Q_k from Z_k, which lives
at W_O's output scale (init std 0.02/sqrt(2L)): the logits are ~1e-3 and at initialisation every
fixed point is the uniform causal average of V, whatever the input. Algorithm 2's Tanh on Z_{k+1}
leaves a small iterate small (still degenerate); normalising Z_k alone rescales it but divides
perturbations by rms(Z), which breaks the contraction where attention is diffuse. N(h + Z_k)
gives input-dependent attention at initialisation, stays contractive, and its first iteration
(Z_0 = h, N(2h) = N(h)) is the paper's.

The causal mask is applied in every iteration; converged tokens may be frozen (selective
update, ``solver.forward.freeze_converged``); the backward is implicit by default. With a cache,
past tokens contribute their converged K and static V, and only new tokens are iterated.

Where convergence is judged (``halting``):
  token   (default) the solved state is Z [B, T, d]: the residual, the freezing and the adjoint's
          mask are per token over all of d_model
  head    the paper's per-token, per-head rule (seed 000, Sec. 3 "We control convergence
          per-token and per-head", App. C.2 "Per-token, per-head halting", App. D Lemma 1): the
          solved state is the heads' outputs U = concat_h(A^(h) V^(h)) before W_O, laid out
          [B, T * H, d_h] (token-major: a view of [B, T, d]), so the solver's "token" is a
          (token, head) pair and its residual, freezing, stop test, padding mask and the implicit
          backward's mask are per head for free. f(U) forms Z = U W_O (the iterate of Eq. (1)) and
          returns the heads' next outputs; Z* = U* W_O. Z_k = U_k W_O for k >= 1 (U_0 = 0: the first
          queries read N(h + 0) = N(h), the paper's first iteration, as Z_0 = h gives with N(2h)).
          The residual of a pair is the relative change of its d_h-vector in ``solver.forward.norm``; the
          paper's ||Z^(i)_{k+1} - Z^(i)_k||_F / ||Z^(i)_k||_F per token is ``norm: l2`` (fpscale
          divides by the new iterate's norm, as for every layer). Under TP each rank holds its own
          heads' pairs: a head's halting is decided where it lives, the stop agreed over the group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fpscale.errors import check
from fpscale.layers.attn import AttnBlock, heads_and_mlp
from fpscale.layers.common import (
    TPSplit,
    apply_rope,
    attention_score_flops,
    causal_attention,
    init_linear,
    linear,
    merge_heads,
    mlp_flops,
    real_tokens,
    rms_norm,
    rope_span,
    spectral_normalize,
    split_heads,
    swiglu_hidden,
)
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.registry import FixedPointSpec
from fpscale.layers.step_cache import TokenBuffer, along, attention_keys, is_static, rope_rows, with_new
from fpscale.solvers.stats import SolverStats

HALTING = ("token", "head")


@dataclass
class FPSASpec(FixedPointSpec):
    """``fpsa``: spectral_norm divides W_Q, W_K by their largest singular value (a power
    iteration per step); temperature learns a softmax temperature per head."""

    type: str = "fpsa"
    spectral_norm: bool = True
    temperature: bool = True
    halting: str = "token"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(self.halting in HALTING, f"{prefix}.halting",
              f"must be one of {', '.join(HALTING)} (token: per token over d_model; head: per token and "
              f"head, seed 000 App. C.2), got {self.halting!r}")

    def build(self, cfg, solver) -> torch.nn.Module:
        return FPSABlock(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return heads_and_mlp(cfg)

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        d = cfg.d_model            # V and the MLP once; Q, K, scores / values and W_O per iteration
        static = 2 * d * d + mlp_flops(d, swiglu_hidden(d, cfg.mlp_ratio))
        return static, 2 * 3 * d * d + attention_score_flops(d, seq_len)


def token_major(table: torch.Tensor) -> torch.Tensor:
    """A rope table of ``rope_span`` ([T, dh/2], or [B, 1, T, dh/2] with padding) laid out to
    rotate [B, T, H, dh]: [T, 1, dh/2], or [B, T, 1, dh/2]."""
    return table.unsqueeze(-2) if table.dim() == 2 else table.transpose(1, 2)


class FPSAttention(FixedPointLayer):
    def __init__(self, d_model: int, n_heads: int, rope_theta: float, init_std: float, out_std: float,
                 solver, spectral_norm: bool = True, temperature: bool = True, power_iters: int = 1,
                 norm_eps: float = 1e-6, halting: str = "token"):
        super().__init__(solver)
        self.norm_eps = norm_eps
        self.halting = halting
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.spectral_norm, self.power_iters = spectral_norm, power_iters
        self.w_q = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_k = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_v = torch.nn.Parameter(torch.empty(d_model, d_model))
        self.w_o = torch.nn.Parameter(torch.empty(d_model, d_model))
        for w in (self.w_q, self.w_k, self.w_v):
            init_linear(w, init_std)
        init_linear(self.w_o, out_std)
        self.log_temp = torch.nn.Parameter(torch.zeros(n_heads)) if temperature else None
        g = torch.Generator().manual_seed(0)
        self.register_buffer("u_q", F.normalize(torch.randn(d_model, generator=g), dim=0))
        self.register_buffer("u_k", F.normalize(torch.randn(d_model, generator=g), dim=0))

    def tp_plan(self) -> dict[str, TPSplit]:
        """Rows are heads (the power-iteration vectors u_q, u_k too); W_O by columns."""
        plan = {name: TPSplit(0) for name in ("w_q", "w_k", "w_v", "u_q", "u_k")}
        plan["w_o"] = TPSplit(1)
        if self.log_temp is not None:
            plan["log_temp"] = TPSplit(0)
        return plan

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_Q, W_K divided by their largest singular values (the power iteration advances once
        per optimizer step: ``advance_power_step``)."""
        if not self.spectral_norm:
            return self.w_q, self.w_k
        update = self.advance_power_step()
        total = self.shards.total
        return (spectral_normalize(self.w_q, self.u_q, self.power_iters, update, total),
                spectral_normalize(self.w_k, self.u_k, self.power_iters, update, total))

    def qk_weight(self) -> tuple[torch.Tensor, float]:
        """[W_Q~; W_K~] stacked, so each iteration projects queries and keys in one product, and
        the logit scale left to the attention. With ``temperature`` each head's tau_h / sqrt(d_h)
        multiplies its rows of W_Q~ here, once per forward, instead of q in every iteration
        (rope is linear, so rope(q) tau_h = rope(q tau_h)); the attention's own scale is then 1."""
        wq, wk = self.qk_weights()
        scale = self.head_dim ** -0.5
        if self.log_temp is not None:      # one temperature per (local) head
            rows = (self.log_temp.exp() * scale).repeat_interleave(self.head_dim)
            wq, scale = wq * rows[:, None].to(wq.dtype), 1.0
        return torch.cat([wq, wk]), scale

    def queries_and_keys(self, z, h, w_qk, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Q_k, K_k [B, H, T, dh] of the iterate z: the normalisation step N(h + z) (what Q and K
        see of the iterate), one product with [W_Q~; W_K~], rope on both at once. Rope rotates the
        product as it lies, [B, T, 2H, dh] (``cos``, ``sin`` from ``token_major``), and the heads
        are then a transposed view: the values of rope on the [B, 2H, T, dh] view, without writing
        its result across the strided layout (the block's training step: 0.98x on a CPU)."""
        zn = self.shards.enter(rms_norm(h + z, None, self.norm_eps))
        qk = linear(zn, w_qk)
        qk = apply_rope(qk.view(*qk.shape[:-1], -1, self.head_dim), cos, sin).transpose(1, 2)   # [B, 2H, T, dh]
        return qk.chunk(2, dim=1)

    def step(self, z, h, w_qk, v, cos, sin, scale: float, past_k=None, pad=None, keys: list | None = None):
        """One application of f: Z_k -> Z_{k+1} (``v``: past and new values; ``past_k``: the
        earlier tokens' keys at this iteration, or None; ``keys``: gets the new tokens' keys)."""
        q, k = self.queries_and_keys(z, h, w_qk, cos, sin)
        if keys is not None:
            keys.append(k)
        k_all = k if past_k is None else with_new(past_k, k, 2)
        return self.shards.exit(F.linear(merge_heads(causal_attention(q, k_all, v, scale, pad=pad)), self.w_o))

    def project(self, u: torch.Tensor) -> torch.Tensor:
        """Z = U W_O [B, T, d] from the heads' outputs U [B, T * H, d_h] (this rank's heads)."""
        return self.shards.exit(linear(u.reshape(u.shape[0], -1, self.w_o.shape[1]), self.w_o))

    def head_step(self, u, h, w_qk, v, cos, sin, scale: float, past_k=None, pad=None,
                  keys: list | None = None) -> torch.Tensor:
        """One application of f in ``halting: head``: U_k [B, T * H, d_h] -> U_{k+1} (Z_k = U_k W_O)."""
        q, k = self.queries_and_keys(self.project(u), h, w_qk, cos, sin)
        if keys is not None:
            keys.append(k)
        k_all = k if past_k is None else with_new(past_k, k, 2)
        out = causal_attention(q, k_all, v, scale, pad=pad)           # [B, H, T, dh]
        return out.transpose(1, 2).reshape(u.shape)

    def forward(self, h: torch.Tensor, pos: int = 0, cache: dict | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        w_qk, scale = self.qk_weight()     # under TP: this rank's heads; z stays whole
        v = split_heads(F.linear(self.shards.enter(h), self.w_v), self.head_dim)
        steps = self.step_cache(cache) if cache is not None else None     # the keys of every iteration
        past_v = cache.get("v") if cache is not None else None       # a TokenBuffer (static V)
        v_all = v if past_v is None else past_v.with_new(v)
        cos, sin = (token_major(t) for t in rope_span(self.head_dim, pos, h.shape[1], self.rope_theta, h, pad))
        heads = self.halting == "head"
        method = self.head_step if heads else self.step
        step = self.compiled(method) if cache is None else method     # decoding stays eager
        real = real_tokens(pad, pos, h.shape[1])
        static = is_static(cache)       # a static decoding step's keys: the cache's capacity, masked
        keys = attention_keys(cache, past_v is not None, pad, pos, h.shape[1], self.token_capacity, h.device)
        if heads:
            n_heads = v.shape[1]
            if self.solver.anderson and self.shards.consensus is not None:
                raise ValueError("fpsa halting: head with solver.anderson under tensor parallelism: each rank "
                                 "holds its own heads' state, so Anderson's per-sample mixing would differ by "
                                 "rank; set solver.forward.anderson=0 or halting=token")
            z0 = h.new_zeros(h.shape[0], h.shape[1] * n_heads, self.head_dim)
            real = None if real is None else real.repeat_interleave(n_heads, dim=1)
        else:
            n_heads, z0 = 1, h
        self.entries_per_token = n_heads     # per token decisions over the token's heads (solver.forward.decisions)
        self.entries_split = heads           # under TP each rank holds its own heads' entries
        def map_of(steps, h, v_all, cos, sin, pad):      # f over every row, or a restriction's (``rows``)
            def f(z):
                if steps is None:
                    return step(z, h, w_qk, v_all, cos, sin, scale, None, pad)
                new_k: list = []
                out = step(z, h, w_qk, v_all, cos, sin, scale, steps.past("k"), pad, new_k)
                steps.record(k=new_k[0].contiguous())
                return out
            return f
        f = map_of(steps, h, v_all, cos, sin, keys)      # keys: pad, or a static step's mask

        def rows(index):        # f on rows ``index`` (decoding's row compaction: fpscale.solvers.rows), sliced once
            assert steps is not None
            return map_of(steps.rows(index, h.shape[1]), h.index_select(0, index), v_all.index_select(0, index),
                          *rope_rows(cos, sin, pad, index))

        # with freezing, the solver counts each entry's iterations (a frozen entry is not updated)
        z = self.fixed_point(f, z0, real, steps, count_entries=self.solver.freeze_converged, rows=rows)
        self.last_stats = FPSAStats(self.last_stats, n_heads, real,  # type: ignore
                                    self.head_offset(n_heads) if heads else None)
        if heads:
            z = self.project(z)
        if cache is not None:
            steps.store(cache, {"k": along(2)})          # k: [B, H, T, dh] per entry
            if past_v is None:
                cache["v"] = TokenBuffer(v.detach(), 2, self.token_capacity, static)
            else:
                past_v.advance(v.shape[2])
        return z.to(h.dtype)

    def head_offset(self, n_local: int) -> int:
        """The global index of this rank's first head (its TP rank times its number of heads)."""
        group = getattr(self.shards, "group", None)
        return 0 if group is None else torch.distributed.get_rank(group) * n_local


class FPSAStats:
    """The solve's SolverStats plus, with freezing, the iterations that updated each entry before it froze
    (the solver's ``entry_iterations``, [B, T * H]) per head (``halting: head``, this rank's heads:
    ``head_offset`` is the first one's global index) and their mean over real entries. Without freezing
    every entry ran ``iterations``. Every other attribute is the solve's own object's, read through (the
    implicit backward sets ``backward_iterations`` on it after the forward)."""

    def __init__(self, base: SolverStats, n_heads: int, real: torch.Tensor | None, head_offset: int | None):
        self.base, self.n_heads, self.real, self.head_offset = base, n_heads, real, head_offset

    def __getattr__(self, name: str):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def per_head(self) -> torch.Tensor:
        """[H] mean iterations of each head's real entries (one value in halting: token)."""
        n = self.entry_iterations.float().view(self.entry_iterations.shape[0], -1, self.n_heads)
        w = (torch.ones_like(n) if self.real is None else self.real.float().view_as(n))
        return (n * w).sum((0, 1)) / w.sum((0, 1)).clamp_min(1)

    def summary(self) -> torch.Tensor:
        base = self.base.summary()
        if self.entry_iterations is None:
            return base
        return torch.cat([base, self.per_head().to(device=base.device, dtype=base.dtype)])

    def from_summary(self, values: list[float]) -> dict:
        if self.entry_iterations is None:
            return self.base.from_summary(values)
        n_base = len(values) - self.n_heads
        out = self.base.from_summary(values[:n_base])
        heads = values[n_base:]
        out["entry_iterations_mean"] = sum(heads) / len(heads)
        if self.head_offset is not None:
            out["head_iterations"] = {self.head_offset + i: v for i, v in enumerate(heads)}
        return out

    def to_dict(self) -> dict:
        return self.from_summary(self.summary().tolist())


class FPSABlock(AttnBlock):
    """The attn block with fixed-point self-attention; the MLP stays outside the loop (the part
    ``checkpoint: mlp`` or ``block`` recomputes: the solve is never run again in backward)."""

    looped_attention = True

    def make_attention(self, cfg, spec, solver, out_std: float) -> torch.nn.Module:
        return FPSAttention(cfg.d_model, cfg.n_heads, cfg.rope_theta, cfg.init_std, out_std, solver,
                            spectral_norm=spec.spectral_norm, temperature=spec.temperature, norm_eps=cfg.norm_eps,
                            halting=spec.halting)
