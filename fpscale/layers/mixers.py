"""Input-dependent channel mixers Q_t of FP-Mamba (seed 002, section 3 and App. C).

Each mixer acts on v in R^{d_inner} per token and is conditioned on (x_t, y_{t-1}):
  householder  Q = prod_i (I - a_i u_i u_i^T),   a_i in (0, 1/r)
  dplr         Q = I - sum_i a_i u_i u_i^T,      a_i in (0, 1/r)
  kronecker    Q = I - a K1 (x) K2,              K = M M^T / (bound on lambda_max), a in (0, 1)
  none         Q = I
u_i = normalize(U_x x + U_y y),  a_i = sigmoid(w_x . x + w_y . y + b_i) (scaled to its range).
Theorem 3.1 wants ||I - Q|| < 1, and each range above proves it:
  householder  I - Q_k = (I - Q_{k-1}) + Q_{k-1} a_k u_k u_k^T with ||Q_{k-1}|| <= 1, so
               ||I - Q|| <= sum_i a_i < 1. The seed's a_i in (0, 1) proves it only for r = 1:
               two reflections 45 degrees apart with a = 0.99 give ||I - Q|| = 1.138.
  dplr         ||sum_i a_i u_i u_i^T|| <= sum_i a_i < 1.
  kronecker    ||K1 (x) K2|| = ||K1|| ||K2|| <= 1 and a < 1.
``negative_eigs`` doubles the coefficients as seed 002 (App. C.3) and its authors' code do
(dr-faustus/fp-rnn, models/mixer.py: ``HouseholderProducts.forward`` line 61, ``DPLR.forward``
line 85 and ``KroneckerProduct.forward`` line 178 all subtract ``2 * alpha * ...``, in every run):
a_i in (0, 2) for each Householder factor (eigenvalue 1 - a_i in (-1, 1)), a_i in (0, 2) for each
DPLR term (not 2/r: the eigenvalues of I - 2 sum_i a_i u_i u_i^T reach down to 1 - 2r), a in (0, 2)
for Kronecker, so Q reaches eigenvalues below 0 (state tracking needs them) at the cost of the
contraction guarantee (||I - Q|| < 2 for Householder and Kronecker, < 2r for DPLR).

Two more of the authors' choices are switches (``apply_mixer``): ``u_activation`` ``silu``
(u_i = normalize(SiLU(U [x; y])), models/mixer.py line 56; seed 002 App. C.3) and
``kronecker_norm`` ``rows`` (K = M M^T with each row L2-normalised, models/mixer.py lines
169-170, instead of dividing by a bound on its largest eigenvalue: no contraction). The logits are clamped at
``A_LOGIT_MAX`` so that a saturated sigmoid stays strictly inside its range, and the mixer's
algebra runs in at least float32 (a bf16 sigmoid rounds to 1.0 from a logit of about 6).

Under tensor parallelism each rank holds a slice of the d_inner channels of v, x and y; the
``shards`` seam (fpscale.layers.common.Unsharded) completes what needs all channels:
Householder/DPLR build this rank's rows of u_i from the gathered x, y and sum the dot products
u . v, ||u||, w . x over the shards; Kronecker factors mix every channel with every other, so
it gathers v, x, y, applies Q whole (its small parameters replicated) and keeps its own slice.
"""
from __future__ import annotations

import torch

from fpscale.layers.common import Unsharded, linear, wide

# a_i = sigmoid(-2) ~ 0.12 at initialisation: Q starts near I, so the feedback of the previous
# iterate into x~ = Q(x - y) + y starts weak (a contraction) and training can strengthen it.
MIX_BIAS_INIT = -2.0
# sigmoid(15) = 1 - 3e-7 < 1 in float32: a saturated coefficient stays inside its open range
A_LOGIT_MAX = 15.0


def kronecker_factors(n: int) -> tuple[int, int]:
    """The most balanced n = d1 * d2 with d1 <= d2."""
    d1 = int(n ** 0.5)
    while d1 > 1 and n % d1:
        d1 -= 1
    return d1, n // d1


def mixer_flops(kind: str, rank: int, d_inner: int, y_feedback: bool,
                kronecker_norm: str = "eigenvalue") -> tuple[float, float]:
    """Forward FLOPs per token of the mixer: (once per solve, per application). The projections of
    x are computed once (``mixer_static``); those of y and Q v in every application. A Kronecker
    factor costs M M^T and, normalised by its eigenvalue bound, 4 squarings (rows: none)."""
    di = d_inner
    if kind in ("householder", "dplr"):            # u_i and a_i projections of x (and y)
        feed = 2 * rank * di * (di + 1)
        return feed, feed if y_feedback else 0.0
    if kind == "kronecker":     # K1, K2 and a projections, M M^T (and 4 squarings) of each, K1 V K2^T
        d1, d2 = kronecker_factors(di)
        feed = 2 * di * (d1 * d1 + d2 * d2 + 1)
        products = 5 if kronecker_norm == "eigenvalue" else 1
        return feed, (feed if y_feedback else 0.0) + products * 2 * (d1 ** 3 + d2 ** 3) + 2 * di * (d1 + d2)
    return 0.0, 0.0


def coefficient_scale(kind: str, rank: int, negative_eigs: bool) -> float:
    """The upper end of a_i's range (a_i = scale * sigmoid(logit)); see the module docstring."""
    if kind == "householder":
        return 2.0 if negative_eigs else 1.0 / rank
    if kind == "dplr":
        return 2.0 if negative_eigs else 1.0 / rank
    return 2.0 if negative_eigs else 1.0


def make_mixer_params(kind: str, d_inner: int, rank: int, y_feedback: bool, std: float,
                      bias_init: float = MIX_BIAS_INIT, feedback_init: str = "zero") -> dict[str, torch.nn.Parameter]:
    """The mixer's parameters: x-halves N(0, std); the coefficient bias ``bias_init`` (fpscale
    -2: a_i starts at 0.12 of its range; the authors' 0, as mamba_ssm's ``_init_weights`` zeroes
    every Linear bias: a_i = 2 sigmoid(0) = 1.0 with doubled coefficients). The y-halves: N(0,
    std) (``feedback_init`` zero, fpscale's), or (``linear``) nn.Linear's default init
    U(+-1/sqrt(fan_in)) with the authors' fan_in 2 d_inner of their one Linear of [x; y]
    (models/mixer.py line 41 with models/fp_mamba_block.py line 153)."""
    def p(*shape, scale=std):
        return torch.nn.Parameter(torch.randn(*shape) * scale)

    def p_y(*shape):
        if feedback_init == "linear":
            bound = (2 * d_inner) ** -0.5
            return torch.nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))
        return p(*shape)

    if kind in ("householder", "dplr"):
        params = {"mix_u_x": p(rank * d_inner, d_inner), "mix_a_x": p(rank, d_inner),
                  "mix_a_b": torch.nn.Parameter(torch.full((rank,), float(bias_init)))}
        if y_feedback:
            params.update(mix_u_y=p_y(rank * d_inner, d_inner), mix_a_y=p_y(rank, d_inner))
        return params
    if kind == "kronecker":
        d1, d2 = kronecker_factors(d_inner)
        params = {"mix_k1_x": p(d1 * d1, d_inner), "mix_k2_x": p(d2 * d2, d_inner),
                  "mix_a_x": p(1, d_inner), "mix_a_b": torch.nn.Parameter(torch.full((1,), float(bias_init)))}
        if y_feedback:
            params.update(mix_k1_y=p_y(d1 * d1, d_inner), mix_k2_y=p_y(d2 * d2, d_inner), mix_a_y=p_y(1, d_inner))
        return params
    return {}


def mixer_static(kind: str, params: dict, x: torch.Tensor, shards=Unsharded()) -> dict[str, torch.Tensor]:
    """The halves W_x x of the mixer's projections that see only the static input x: the same in
    every application of f, so a solve computes them once and passes them to ``apply_mixer``."""
    if kind in ("householder", "dplr"):
        return {"u": linear(shards.enter(shards.gather(x)), params["mix_u_x"]), "a": linear(x, params["mix_a_x"])}
    if kind == "kronecker":
        whole_x = shards.gather(x)
        return {name: linear(whole_x, params[f"mix_{name}_x"]) for name in ("k1", "k2", "a")}
    return {}


def _proj(params, name, x, y, static=None):
    """W_x x + W_y y in the weights' dtype, returned in at least float32 (W_x x from ``static``
    when given: the same numbers, computed once per solve)."""
    out = static[name] if static is not None else linear(x, params[f"mix_{name}_x"])
    if y is not None and f"mix_{name}_y" in params:
        out = out + linear(y, params[f"mix_{name}_y"])
    return wide(out)


def _coefficients(logits: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.sigmoid(logits.clamp(max=A_LOGIT_MAX))


def _normalized_psd(m: torch.Tensor, squarings: int = 4) -> torch.Tensor:
    """K = M M^T divided by an upper bound of its largest eigenvalue, per token.

    Power iteration approaches lambda_max from below, which would leave ||K|| > 1; repeated
    squaring bounds it from above: lambda_max(K) <= ||K^(2^s)||_F^(2^-s), within a factor
    n^(2^-(s+1)) of lambda_max. Each square is renormalised, so nothing overflows.
    """
    k = m @ m.transpose(-1, -2)
    c = torch.linalg.matrix_norm(k).clamp_min(1e-12)
    log_bound = c.log()
    p = k / c[..., None, None]
    for j in range(1, squarings + 1):
        p = p @ p
        cj = torch.linalg.matrix_norm(p).clamp_min(1e-30)
        log_bound = log_bound + cj.log() / 2 ** j
        p = p / cj[..., None, None]
    return k / log_bound.exp()[..., None, None]


def _rows_normalized(m: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """K = M M^T with each row divided by its L2 norm (the authors' Kronecker factors,
    models/mixer.py lines 162-170): ||K||_2 may exceed 1, so no contraction."""
    k = m @ m.transpose(-1, -2)
    return k / torch.linalg.vector_norm(k, dim=-1, keepdim=True).clamp_min(eps)


def _activation(t: torch.Tensor, name: str) -> torch.Tensor:
    return torch.nn.functional.silu(t) if name == "silu" else t


def apply_mixer(kind: str, params: dict, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None,
                negative_eigs: bool = False, shards=Unsharded(), static: dict | None = None,
                u_activation: str = "none", kronecker_norm: str = "eigenvalue") -> torch.Tensor:
    """Q_t v for v, x, y of shape [B, T, d_inner] (this shard's channels under TP), computed in
    at least float32 (v is a difference of the iterate: fpscale.solvers.precision). ``static``:
    ``mixer_static(kind, params, x, shards)``, computed once per solve (None: computed here).
    ``u_activation`` (none | silu) acts on the projections before u_i is normalised (Kronecker:
    on M's entries); ``kronecker_norm`` (eigenvalue | rows) normalises K1, K2."""
    if kind == "none":
        return v
    v = wide(v)
    if kind in ("householder", "dplr"):
        B, T, di = v.shape
        rank = params["mix_a_b"].shape[0]
        whole_x = None if static is not None else shards.enter(shards.gather(x))
        whole_y = None if y is None else shards.enter(shards.gather(y))
        u = _activation(_proj(params, "u", whole_x, whole_y, static).view(B, T, rank, di), u_activation)
        u = u * torch.rsqrt(shards.total(u.pow(2).sum(-1, keepdim=True)) + 1e-12)
        logits = shards.exit(_proj(params, "a", x, y, static)) + params["mix_a_b"]
        a = shards.enter(_coefficients(logits, coefficient_scale(kind, rank, negative_eigs)))   # [B, T, rank]
        if kind == "householder":
            for i in range(rank):
                ui = u[:, :, i]
                v = v - a[..., i:i + 1] * ui * shards.total((ui * v).sum(-1, keepdim=True))
            return v
        dots = shards.total((u * v.unsqueeze(2)).sum(-1, keepdim=True))           # [B, T, rank, 1]
        return v - (a.unsqueeze(-1) * dots * u).sum(2)
    if kind == "kronecker":
        v = shards.gather(v)
        x = shards.gather(x) if static is None else x
        y = None if y is None else shards.gather(y)
        B, T, di = v.shape
        d1, d2 = kronecker_factors(di)
        norm = _rows_normalized if kronecker_norm == "rows" else _normalized_psd
        k1 = norm(_activation(_proj(params, "k1", x, y, static), u_activation).view(B, T, d1, d1))
        k2 = norm(_activation(_proj(params, "k2", x, y, static), u_activation).view(B, T, d2, d2))
        a = _coefficients(_proj(params, "a", x, y, static) + params["mix_a_b"],
                          coefficient_scale(kind, 1, negative_eigs))                # [B, T, 1]
        kv = (k1 @ v.view(B, T, d1, d2) @ k2.transpose(-1, -2)).reshape(B, T, di)
        return shards.scatter(v - a * kv)
    raise ValueError(f"unknown channel mixer {kind!r}")
