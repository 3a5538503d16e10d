"""fpmamba2 (FP-Mamba2, seed 002 App. E.2): its SSD scan and one application of f against float64
references written out from the recurrence, causality, cached decoding = recomputation, bf16
iterations beside fp32, FLOPs against torch's counter, and its Triton path = its PyTorch scan
(under Triton's interpreter, in a child process as tests/ops/test_scan_triton.py). TP2 = one
process: tests/parallel/run_tp_model.py (cases fpmamba2-*)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fpscale
from fpscale.layers.fpmamba2 import FPMamba2Mixer
from fpscale.models import layer_spec
from fpscale.ops.ssd import ssd_scan, via_selective_scan
from fpscale.solvers import SolverConfig
from tests.layers.test_fpmamba_switches import dense_q, reference_params
from tests.models.helpers import assert_iterates_alike, solver_iterations, tiny_model, token_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def recurrence(x, dt, A, B, C, h0=None):
    """h_t[h] = exp(dt_t[h] A_h) h_{t-1}[h] + dt_t[h] x_t[h] B_t[g(h)]^T, y_t[h] = h_t[h] C_t[g(h)],
    one head and one step at a time (float64)."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    ys = torch.zeros_like(x)
    last = torch.zeros(Bsz, H, P, N, dtype=x.dtype)
    for b in range(Bsz):
        for h in range(H):
            g = h // (H // G)
            s = torch.zeros(P, N, dtype=x.dtype) if h0 is None else h0[b, h]
            for t in range(T):
                s = torch.exp(dt[b, t, h] * A[h]) * s + dt[b, t, h] * torch.outer(x[b, t, h], B[b, t, g])
                ys[b, t, h] = s @ C[b, t, g]
            last[b, h] = s
    return ys, last


def scan_inputs(seed=0, T=11, H=4, G=2, P=3, N=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, H, P, generator=g, dtype=dtype)
    dt = torch.rand(2, T, H, generator=g, dtype=dtype)
    A = -torch.rand(H, generator=g, dtype=dtype) * 3
    B = torch.randn(2, T, G, N, generator=g, dtype=dtype)
    C = torch.randn(2, T, G, N, generator=g, dtype=dtype)
    h0 = torch.randn(2, H, P, N, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, dt, A, B, C, h0)]


def check_scan(fn, atol):
    ins = scan_inputs()
    y, last = fn(*ins)
    want_y, want_last = recurrence(*ins)
    assert torch.allclose(y.double(), want_y, atol=atol, rtol=0), float((y - want_y).abs().max())
    assert torch.allclose(last.double(), want_last, atol=atol, rtol=0)
    w = torch.cos(want_y.detach())
    got = torch.autograd.grad((y * w).sum(), ins)
    want = torch.autograd.grad((want_y * w).sum(), ins)
    for name, a, b in zip("x dt A B C h0".split(), got, want):
        assert torch.allclose(a.double(), b, atol=atol * 10, rtol=0), (name, float((a - b).abs().max()))


@pytest.mark.parametrize("chunk", [4, 64], ids=["3-chunks-T-not-a-multiple", "one-chunk"])
def test_ssd_scan_is_the_recurrence(chunk):
    """Values, last state and the gradients of x, dt, A, B, C and h0; 4 heads in 2 groups."""
    check_scan(lambda *a: ssd_scan(*a, chunk=chunk), 1e-12)


def test_the_fused_path_is_the_recurrence():
    """``via_selective_scan`` (what CUDA runs: per group, the Mamba-1 selective scan with A and dt
    repeated over each head's channels), here through the PyTorch selective scan."""
    check_scan(via_selective_scan, 1e-12)


def reference_f(m, x, y):
    """One application of f and the layer's output before W_out (float64), written from the module doc."""
    P = reference_params(m, m.wn_groups != {})
    sw = {"mixer": m.mixer, "rank": P["mix_a_b"].shape[0] if "mix_a_b" in P else 1,
          "u_activation": m.u_activation, "negative_eigs": m.negative_eigs, "kronecker_norm": m.kronecker_norm}
    Bsz, T, _ = x.shape
    di, H, hp, G, N = m.d_inner, m.nheads, m.headdim, m.ngroups, m.d_state
    z, u, bc = x @ P["w_z"].T, x @ P["w_x"].T, x @ P["w_bc"].T
    dt = F.softplus(x @ P["w_dt"].T + P["dt_bias"])
    A = -P["A_log"].exp()
    y_s = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], 1)
    y_new = torch.zeros_like(y)
    for b in range(Bsz):
        state = torch.zeros(H, hp, N, dtype=torch.float64)
        for t in range(T):
            x_tilde = dense_q(P, sw, u[b, t], y_s[b, t], di) @ (u[b, t] - y[b, t]) + y[b, t]
            bct = bc[b, t] + P["y_proj"] @ y_s[b, t]
            Bt, Ct = bct[:G * N].view(G, N), bct[G * N:].view(G, N)
            Bt, Ct = Bt / Bt.norm(dim=1, keepdim=True), Ct / Ct.norm(dim=1, keepdim=True)
            out = torch.zeros(di, dtype=torch.float64)
            for h in range(H):
                g, ch = h // (H // G), slice(h * hp, (h + 1) * hp)
                state[h] = torch.exp(dt[b, t, h] * A[h]) * state[h] + dt[b, t, h] * torch.outer(x_tilde[ch], Bt[g])
                out[ch] = state[h] @ Ct[g] + P["D"][h] * x_tilde[ch]
            out = F.silu(z[b, t]) * out
            y_new[b, t] = out / torch.sqrt(out.pow(2).mean() + 1e-6) * P["out_norm_w"]
    if m.gate == "inside":
        return y_new, y_new
    y_new_s = torch.cat([torch.zeros_like(y_new[:, :1]), y_new[:, :-1]], 1)
    return y_new, F.silu(z + y_new_s @ P["z_y_proj"].T) * y_new


def build(**kw):
    torch.manual_seed(0)
    spec = layer_spec("fpmamba2", d_state=3, headdim=4, **kw)
    m = FPMamba2Mixer(8, spec, SolverConfig(), 0.2, 0.2, 1e-6).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name not in ("A_log", "dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("kw", [{}, {"mixer": "householder", "mixer_rank": 2, "gate": "inside", "ngroups": 2,
                                     "weight_norm": False, "u_activation": "none", "negative_eigs": False}],
                         ids=["authors-defaults-kronecker", "householder-inside-2groups"])
def test_one_application_of_f_matches_the_reference(kw):
    m = build(**kw)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    y = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        z, u, bc = F.linear(x, m.w_z), F.linear(x, m.w_x), F.linear(x, m.w_bc)
        dt = F.softplus(F.linear(x, m.w_dt) + m.dt_bias)
        static = m.static(u)
        y_new = m.step(y, u, F.silu(z), bc, dt, static=static)
        want_y, want_out = reference_f(m, x, y)
        assert torch.allclose(y_new, want_y, rtol=1e-10, atol=1e-10), float((y_new - want_y).abs().max())
        if m.gate == "both":
            ys = torch.cat([torch.zeros_like(y_new[:, :1]), y_new[:, :-1]], 1)
            out = F.silu(z + F.linear(ys, static["weights"]["z_y_proj"])) * y_new
            assert torch.allclose(out, want_out, rtol=1e-10, atol=1e-10)


CONTRACTIVE = {"negative_eigs": False, "mixer_bias_init": -2.0, "kronecker_norm": "eigenvalue"}  # one fixed point
TIGHT = {"tol": 1e-8, "max_iter": 400, "patience": 0, "damping": 0.5}


def model2(dtype=torch.float64, **kw):
    return tiny_model("fpmamba2", d=16, dtype=dtype, d_state=4, headdim=8, **{**CONTRACTIVE, **kw})


@pytest.mark.parametrize("kw", [{}, {"input_path": "conv_silu", "ngroups": 2, "mixer": "householder"}],
                         ids=["defaults", "conv-2groups-householder"])
def test_causality_and_cached_decoding(kw):
    model = model2(solver=TIGHT, **kw).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (2, 10), generator=g)
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 32
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    (layer,) = model.fixed_point_layers().values()
    assert layer.last_stats.stopped_by == "converged"
    assert torch.allclose(a[:, :6], b[:, :6], rtol=0, atol=1e-7) and not torch.allclose(a[:, 6:], b[:, 6:], atol=1e-3)
    prompt = tokens[:, :4]
    cached, cached_logits = fpscale.generate(model, prompt, 5, use_cache=True, return_logits=True)
    full, full_logits = fpscale.generate(model, prompt, 5, use_cache=False, return_logits=True)
    assert torch.equal(cached, full)
    assert torch.allclose(cached_logits, full_logits, rtol=0, atol=1e-7)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_bf16_takes_the_iterations_of_fp32(training):
    """The authors' defaults (doubled range), the seeds' tol 0.1: bf16 weights and autocast within
    1.25x of fp32's iterations."""
    solver = {"tol": 0.1, "max_iter": 40, "patience": 5, "decay": 0.7, "eta_min": 0.01}
    model = tiny_model("fpmamba2", d=32, d_state=8, headdim=8, solver=solver)
    batches = token_batches(32, n=2, batch=4, seq=32)
    ref = solver_iterations(model.hidden, model, batches, training)
    cast = tiny_model("fpmamba2", d=32, d_state=8, headdim=8, solver=solver).to(torch.bfloat16)
    assert_iterates_alike(ref, solver_iterations(cast.hidden, cast, batches, training), ".to(bfloat16)")
    assert_iterates_alike(ref, solver_iterations(model.hidden, model, batches, training, autocast=True), "autocast")


def test_flops_match_torch_flop_counter(monkeypatch):
    """Declared FLOPs against torch.utils.flop_counter over 3 iterations, with the scan swapped for
    the elementwise recurrence (which the counter does not see) and its declared share taken out."""
    from torch.utils.flop_counter import FlopCounterMode

    import fpscale.layers.fpmamba2 as fpm2
    from fpscale.layers.fpmamba_map import scan_flops
    from tests.models.helpers import tiny_config

    def elementwise(x, dt, A, B, C, h0=None):
        Bsz, T, H, P = x.shape
        Bh, Ch = (t.repeat_interleave(H // B.shape[2], dim=2) for t in (B, C))
        s = torch.zeros(Bsz, H, P, B.shape[-1], dtype=x.dtype) if h0 is None else h0
        ys = []
        for t in range(T):
            s = torch.exp(dt[:, t] * A)[..., None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * \
                Bh[:, t, :, None]
            ys.append((s * Ch[:, t, :, None]).sum(-1))
        return torch.stack(ys, 1), s

    monkeypatch.setattr(fpm2, "ssd", elementwise)
    B, T, d, k = 2, 8, 32, 3
    for spec in ({"d_state": 4, "headdim": 8}, {"d_state": 4, "headdim": 8, "mixer": "dplr", "input_path": "conv_silu",
                                                "gate": "inside", "ngroups": 2, "mlp": True}):
        cfg = tiny_config("fpmamba2", d=d, solver={"tol": 0.0, "max_iter": k, "eval_max_iter": k}, **spec)
        model = fpscale.build_model(cfg).eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.layers[0](torch.randn(B, T, d))
        ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        layer = cfg.model.layers[0]
        static, per_iter = layer.flops(cfg.model, T)
        declared = static + k * (per_iter - scan_flops(layer.expand * d, layer.d_state))
        assert sum(ops.values()) / (B * T) == pytest.approx(declared, rel=1e-9), spec


# ---- Triton: the fused path under Triton's interpreter (a child process, as test_scan_triton.py) ----

@pytest.mark.skipif(not INTERPRETED, reason="a kernel test: run under TRITON_INTERPRET=1 by "
                                            "test_the_triton_path_under_the_interpreter (child process)")
def test_kernel_triton_path_equals_the_pytorch_scan():
    """``ssd`` with FPSCALE_TRITON_SCAN=1 on CPU runs fpscale's Triton selective scan (interpreted)
    per group; it equals ``ssd_scan`` in float32: values, last state and every gradient."""
    from fpscale.ops import kernels
    from fpscale.ops.ssd import ssd
    ins = scan_inputs(T=9, H=4, G=2, P=4, N=4, dtype=torch.float32)
    kernels.reset()
    y, last = ssd(*ins)
    assert kernels.used() == {"ssd": {"selective-scan": 1}, "scan": {"triton": 2}}
    want_y, want_last = ssd_scan(*ins, chunk=4)
    assert torch.allclose(y, want_y, atol=1e-5, rtol=1e-5) and torch.allclose(last, want_last, atol=1e-5, rtol=1e-5)
    w = torch.cos(want_y.detach())
    for name, a, b in zip("x dt A B C h0".split(), torch.autograd.grad((y * w).sum(), ins),
                          torch.autograd.grad((want_y * w).sum(), ins)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (name, float((a - b).abs().max()))


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="the parent of the interpreted kernel test")
def test_the_triton_path_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FPSCALE_TRITON_SCAN": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_kernel_"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
