"""Each layer type: causality, the fixed-point property, and its reductions to a plain layer."""
import math

import pytest
import torch
import torch.nn.functional as F

from fpscale.layers.common import apply_rope, merge_heads, rope_tables, split_heads
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.ops.attention import causal_attention
from fpscale.ops.scan import sequential_scan
from fpscale.solvers import token_residual
from tests.models.helpers import TYPES, tiny_model

TIGHT = {"tol": 1e-6, "max_iter": 200, "patience": 0}     # fp32 resolves down to ~1.2e-7


@pytest.mark.parametrize("layer_type", TYPES + ["mixed"])
def test_causality_at_evaluation(layer_type):
    model = tiny_model(layer_type, solver=TIGHT).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (2, 24), generator=g)
    changed = tokens.clone()
    t = 11
    changed[:, t + 1:] = torch.randint(0, 32, (2, 24 - t - 1), generator=g)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # exact for attn; for looped layers the shared stopping time and eta let later tokens
    # move earlier ones by at most the solver tolerance
    atol = 0.0 if layer_type == "attn" else 1e-4
    assert torch.allclose(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=atol), \
        float((a[:, :t + 1] - b[:, :t + 1]).abs().max())
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-3)


def test_fpsa_causality_is_exact_with_freezing():
    """Per-token freezing makes token t's final state a function of tokens <= t alone."""
    model = tiny_model("fpsa", solver={"tol": 1e-5, "max_iter": 200, "patience": 0,
                                       "freeze_converged": True}).eval()
    tokens = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 32
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :12], model(changed)[:, :12])


def capture_solve(layer: FixedPointLayer):
    """Record the map f and the fixed point of the layer's next solve."""
    seen = {}
    orig = layer.fixed_point

    def spy(f, z0, real=None, step_cache=None, **kw):
        z = orig(f, z0, real, step_cache, **kw)
        seen.update(f=f, z=z)
        return z

    layer.fixed_point = spy
    return seen


@pytest.mark.parametrize("layer_type", ["fpsa", "fpmamba", "looped"])
def test_fixed_point_property(layer_type):
    # damping with patience (FPRM Algorithm 1) settles fpmamba's sign-flipping gate channels;
    # damping does not move fixed points, so f(z*) = z* is checked on the undamped f
    model = tiny_model(layer_type, solver={"tol": 1e-5, "max_iter": 300, "patience": 5, "decay": 0.7,
                                           "eta_min": 1e-4}).eval()
    (layer,) = model.fixed_point_layers().values()
    seen = capture_solve(layer)
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 20)))
        z = seen["z"]
        res = token_residual(seen["f"](z), z, "inf", 1e-6)
    assert layer.last_stats.stopped_by == "converged"
    assert float(res.max()) < 1e-5 * 1.5 and layer.last_stats.iterations > 1


def test_iterations_grow_with_sequence_length():
    """fpmamba's iterate couples tokens through y_{t-1}: longer inputs take more iterations."""
    model = tiny_model("fpmamba", solver={"tol": 1e-4, "max_iter": 300, "patience": 0}).eval()
    (layer,) = model.fixed_point_layers().values()
    counts = {}
    for T in (2, 64):
        with torch.no_grad():
            model(torch.randint(0, 32, (4, T), generator=torch.Generator().manual_seed(0)))
        counts[T] = layer.last_stats.iterations
    assert counts[64] > counts[2], counts


def test_fpsa_one_iteration_is_ordinary_attention():
    """Z_0 = h: the first iteration's queries and keys read N(h + h) = N(h), ordinary attention."""
    model = tiny_model("fpsa", solver={"max_iter": 1, "tol": 0.0}, spectral_norm=False,
                       temperature=False).eval()
    attn = model.layers[0].attn
    h = torch.randn(2, 10, 32)
    with torch.no_grad():
        got = attn(h)
        cos, sin = rope_tables(8, torch.arange(10), 10000.0, h.dtype)
        hn = F.rms_norm(h, (32,), eps=1e-6)
        q = apply_rope(split_heads(hn @ attn.w_q.T, 8), cos, sin)
        k = apply_rope(split_heads(hn @ attn.w_k.T, 8), cos, sin)
        v = split_heads(h @ attn.w_v.T, 8)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
        scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
        want = merge_heads(scores.softmax(-1) @ v) @ attn.w_o.T
    assert torch.allclose(got, want, atol=1e-6)


def test_fpmamba_without_mixer_or_feedback_is_a_selective_scan():
    # x~ = (u - y) + y = u: f never reads its iterate, and the layer applies it once
    model = tiny_model("fpmamba", mixer="none", y_feedback=False, solver={"tol": 1e-4, "patience": 0}).eval()
    m = model.layers[0].mixer
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = m(x)
        # plain Mamba (no dependence on the iterate): conv -> SiLU -> selective scan, step by step
        xc, g = (x @ m.w_in.T).chunk(2, -1)
        pad = F.pad(xc, (0, 0, m.d_conv - 1, 0))
        u = torch.stack([F.silu((pad[:, t:t + m.d_conv] * m.conv_w[:, 0].T).sum(1) + m.conv_b)
                         for t in range(9)], 1)
        dt_low, Bm, Cm = (u @ m.x_proj.T).split([m.dt_rank, m.d_state, m.d_state], -1)
        Bm, Cm = F.normalize(Bm, dim=-1), F.normalize(Cm, dim=-1)
        delta = F.softplus(dt_low @ m.dt_proj.T + m.dt_bias)
        lam = torch.exp(-delta[..., None] * m.A_log.exp())
        h = sequential_scan(lam, (delta * u)[..., None] * Bm[:, :, None])
        y = F.silu(g) * ((h * Cm[:, :, None]).sum(-1) + m.D * u)
        y = F.rms_norm(y, (m.d_inner,), m.out_norm_w, 1e-6)
        want = y @ m.w_out.T
    assert m.last_stats.iterations == 1      # f is constant in y: f(0) is z* (solve's apply_once)
    assert torch.allclose(got, want, atol=1e-5)


def test_looped_core_run_once_is_a_plain_stack():
    model = tiny_model("looped", solver={"max_iter": 1, "tol": 0.0}, core_blocks=2).eval()
    core = model.layers[0]
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        got = core(x)
        a1, b1, a2, b2 = core.scalings()
        z = b2 * x                     # s_0 = 0: the first pass starts from the re-injected input
        cos, sin = rope_tables(8, torch.arange(7), 10000.0, x.dtype)
        for l in range(2):
            h = F.rms_norm(z, (32,), core.attn_norm[l], 1e-6)
            q, k, v = (split_heads(t, 8) for t in (h @ core.w_qkv[l].T).chunk(3, -1))
            o = causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            z = a1 * z + b1 * (merge_heads(o) @ core.w_o[l].T)
            h = F.rms_norm(z, (32,), core.mlp_norm[l], 1e-6)
            z = a1 * z + b1 * ((F.silu(h @ core.w_gate[l].T) * (h @ core.w_up[l].T)) @ core.w_down[l].T)
    assert torch.allclose(got, z, atol=1e-6)
    # Theorem 1's tied scalings
    L = 4
    assert torch.allclose(b2, 1 - a2 * a1 ** L) and torch.allclose(b1, b2 * (1 - a1) / (1 - a1 ** L))


def test_fpsa_implicit_gradient_matches_dense_jacobian():
    from torch.func import jacrev
    torch.manual_seed(0)
    model = tiny_model("fpsa", d=8, solver={"tol": 1e-13, "max_iter": 400, "backward": "implicit",
                                            "backward_tol": 1e-13, "backward_max_iter": 400, "patience": 0},
                       spectral_norm=False, temperature=False, dtype=torch.float64)
    attn = model.layers[0].attn
    h = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 4, 8, dtype=torch.float64)
    (c * attn(h)).sum().backward()
    cos, sin = rope_tables(2, torch.arange(4), 10000.0, torch.float64)

    def f_ref(z, wq, wk, wv, wo, hh):     # an independent functional copy of the FPSA map
        r = hh + z
        r = r / (r.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()      # N(h + Z)
        q = apply_rope(split_heads(r @ wq.T, 2), cos, sin)
        k = apply_rope(split_heads(r @ wk.T, 2), cos, sin)
        return merge_heads(causal_attention(q, k, split_heads(hh @ wv.T, 2))) @ wo.T

    W = [p.detach() for p in (attn.w_q, attn.w_k, attn.w_v, attn.w_o)]
    hd = h.detach()
    with torch.no_grad():
        z = hd.clone()
        for _ in range(1000):
            z = f_ref(z, *W, hd)
    N = z.numel()
    J = jacrev(lambda zz: f_ref(zz, *W, hd))(z).reshape(N, N)
    u = torch.linalg.solve((torch.eye(N, dtype=torch.float64) - J).T, c.reshape(N))
    for i, (name, got) in enumerate(zip(("w_q", "w_k", "w_v", "w_o"),
                                         (attn.w_q.grad, attn.w_k.grad, attn.w_v.grad, attn.w_o.grad))):
        jac = jacrev(lambda w: f_ref(z, *W[:i], w, *W[i + 1:], hd))(W[i]).reshape(N, -1)
        want = (u @ jac).reshape(W[i].shape)
        assert float((got - want).norm() / want.norm()) < 1e-6, name
    want_h = (u @ jacrev(lambda hh: f_ref(z, *W, hh))(hd).reshape(N, -1)).reshape(hd.shape)
    assert float((h.grad - want_h).norm() / want_h.norm()) < 1e-6


def fpsa_attention_at_fixed_point(model, tokens, literal: bool = False):
    """Attention probabilities [B, H, T, T] at FPSA's fixed point; ``literal`` reads Q and K from
    Z itself (seed 000's Eq. 1 as written) instead of N(h + Z)."""
    attn = model.layers[0].attn
    seen = capture_solve(attn)
    with torch.no_grad():
        h = model.layers[0].norm1(model.embed(tokens))
        attn(h)
        z = seen["z"]
        read = z if literal else F.rms_norm(h + z, (h.shape[-1],), eps=1e-6)
        wq, wk = attn.qk_weights()
        T, dh = tokens.shape[1], attn.head_dim
        cos, sin = rope_tables(dh, torch.arange(T), 10000.0, h.dtype)
        q = apply_rope(split_heads(read @ wq.T, dh), cos, sin)
        k = apply_rope(split_heads(read @ wk.T, dh), cos, sin)
        scores = (q @ k.transpose(-1, -2)) * attn.log_temp.exp().view(1, -1, 1, 1) / math.sqrt(dh)
        return scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def test_fpsa_attention_depends_on_the_input_at_initialisation():
    """At the shipped initialisation (GPT-2 scaled W_O) the fixed point's attention is far from the
    uniform causal average and differs between inputs; Q and K read from Z alone (Eq. 1 as written)
    give uniform attention whatever the input."""
    model = tiny_model("fpsa", vocab=256, d=128, solver={"tol": 1e-5, "max_iter": 100}).eval()
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, 256, (2, 64), generator=g) for _ in range(2))
    T = a.shape[1]
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1).view(-1, 1)

    def tv(p, q):
        return float(0.5 * (p - q).abs().sum(-1).mean())

    pa, pb = fpsa_attention_at_fixed_point(model, a), fpsa_attention_at_fixed_point(model, b)
    assert model.layers[0].attn.last_stats.stopped_by == "converged"
    assert tv(pa, uniform) > 0.05 and tv(pa, pb) > 0.05
    la, lb = fpsa_attention_at_fixed_point(model, a, True), fpsa_attention_at_fixed_point(model, b, True)
    assert tv(la, uniform) < 1e-3 and tv(la, lb) < 1e-3
