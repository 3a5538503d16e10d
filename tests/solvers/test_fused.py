"""The fused solver bookkeeping (fpscale.solvers.fused, ``solver.bookkeeping``) against the PyTorch
loop, under Triton's interpreter on CPU: the same iterates, iteration counts, stop reasons, damping
and residuals, float64 and float32, on synthetic maps with every stop rule (convergence, quantile,
eta_min stall, the cap, a non-finite residual), freezing, left padding, the l2 norm, the read
schedules (eager, every N, none), a bf16 map, on every tiny config (forward, adjoint, gradients),
and split over TP 2 (consensus and the state split of FP-Mamba); the kernels per iteration and the
host reads.

As in tests/ops/test_scan_triton.py, the interpreter is chosen when the kernels are defined, so the
kernel tests (``test_kernel_*``) run in a child pytest process with ``TRITON_INTERPRET=1``, started by
``test_the_fused_bookkeeping_under_the_interpreter``; the parent runs the tests that need no kernel.

    python -m pytest tests/solvers/test_fused.py -q
"""
import dataclasses
import functools
import os
import types
import warnings
from pathlib import Path

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.profiling import count_aten_ops, count_host_reads
from fpscale.solvers import SolverConfig, fused
from fpscale.solvers.iterate import iterate
from fpscale.typed import from_dict
from tests.interpreter import run_kernel_tests_interpreted
from tests.models.helpers import token_batches
from tests.parallel.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="a kernel test: run under TRITON_INTERPRET=1 by "
                                                         "test_the_fused_bookkeeping_under_the_interpreter")
# every tiny config with a fixed-point solve (tiny_attn has none; tiny_epsilon halts by its own rule)
# (tiny_attractor: Anderson mixing, which the fused bookkeeping does not run)
TINY = sorted(p.stem for p in (ROOT / "configs").glob("tiny_*.yaml")
              if p.stem not in ("tiny_attn", "tiny_epsilon", "tiny_attractor"))
# tiny_fpsa judged per (token, head) (its state [B, T * H, d_h]), freezing in the adjoint too
VARIANTS = {"tiny_fpsa_heads": ("tiny_fpsa", ["model.layers.1.halting=head", "solver.adjoint.backward_freeze=true"])}


def triton_or_skip() -> None:
    if fused.FUSED_ERROR is not None:
        raise fused.FUSED_ERROR                 # installed but broken: a failure, not a skip
    if not fused.AVAILABLE:
        pytest.skip("triton is not installed (pip install triton): the fused kernels cannot be tested")


def run_child(marker: str) -> None:
    """This file's kernel tests matching ``marker`` in a child under the interpreter: all must run and pass."""
    triton_or_skip()
    run_kernel_tests_interpreted(__file__, marker)


@pytest.mark.slow
def test_the_fused_bookkeeping_under_the_interpreter():
    run_child("not slow")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fused_bookkeeping_under_tp2_under_the_interpreter():
    run_child("slow")


# ------------------------------------------------------------------------------ synthetic maps
def contraction(dtype, B=4, T=6, d=16, seed=0, bf16=False, bad_at=None, bad_sample=1):
    """f(z) = tanh(z W + x), samples of different difficulty (x scaled per sample); ``bad_at``: from
    that application on, sample ``bad_sample`` of f(z) is NaN; ``bf16``: f computes in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5 * 0.4
    scale = torch.linspace(0.2, 3.0, B, dtype=torch.float64)[:, None, None]
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64) * scale
    W, x = W.to(dtype), x.to(dtype)
    calls = [0]

    def f(z):
        calls[0] += 1
        out = torch.tanh(z.to(torch.bfloat16) @ W.bfloat16() + x.bfloat16()) if bf16 else torch.tanh(z @ W + x)
        if bad_at is not None and calls[0] >= bad_at:
            out = out.clone()
            out[bad_sample, 2] = float("nan")
        return out
    return f, torch.zeros(B, T, d, dtype=dtype)


def both(cfg: SolverConfig, dtype, quantile=0.25, real=None, max_iter=None, count_entries=False, **map_kw):
    results = []
    for mode in ("torch", "fused"):
        f, z0 = contraction(dtype, **map_kw)
        with torch.no_grad():
            results.append(iterate(f, z0, dataclasses.replace(cfg, bookkeeping=mode), quantile=quantile,
                                   real=real, max_iter=max_iter, count_entries=count_entries))
    return results


def assert_same(a, b, exact=True):
    assert (a.iterations, a.stopped_by) == (b.iterations, b.stopped_by)
    for name in ("z", "token_res", "token_converged", "eta"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if exact:
            assert torch.equal(x, y), (name, (x.double() - y.double()).abs().max())
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=name)


CASES = {
    "converged": dict(tol=1e-4),
    "quantile": dict(tol=1e-6, max_iter=60),
    "freeze": dict(tol=1e-3, freeze_converged=True),
    "cap": dict(tol=1e-12, max_iter=7),
    "eta_min stall": dict(tol=1e-30, max_iter=150, damping=0.9, patience=1, decay=0.5, eta_min=0.2),
    "patience decays": dict(tol=1e-5, max_iter=60, damping=1.0, patience=2, decay=0.8, eta_min=0.0),
    "tol 0 (one read)": dict(tol=0.0, max_iter=9, eta_min=0.0),
    "check_every 3": dict(tol=1e-4, check_every=3),
    "check_every 4 freeze": dict(tol=1e-3, check_every=4, freeze_converged=True),
    "best so far": dict(tol=1e-4, stop_residual="best", damping=0.9, patience=2, decay=0.8),
    "min_iter": dict(tol=1e-2, min_iter=15),                           # issue 38: holds a stop that could fire
    "min_iter check_every 4": dict(tol=1e-2, min_iter=9, check_every=4),
}


@interpreted
@pytest.mark.parametrize("decisions", ["token", "sample"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_fused_equals_the_pytorch_loop(case, dtype, decisions):
    """Per token (the causal default: damping, patience and retirement per token) and per sample."""
    cfg = SolverConfig(**{"max_iter": 40, "decisions": decisions, **CASES[case]})
    a, b = both(cfg, dtype, quantile=0.25 if case == "quantile" else 0.0)
    assert_same(a, b)
    if decisions == "token":
        assert torch.equal(a.retired_at, b.retired_at)
    expected = {"quantile": "quantile", "cap": "max_iter", "eta_min stall": "eta_min",
                "tol 0 (one read)": "max_iter"}.get(case, "converged")
    assert a.stopped_by == expected, a.stopped_by


@interpreted
@pytest.mark.parametrize("decisions", ["token", "sample"])
@pytest.mark.parametrize("case", ["freeze", "check_every 4 freeze", "cap"])
def test_kernel_per_entry_counts_as_the_pytorch_loop(case, decisions):
    """``count_entries`` (fpsa's per-head iterations): the steps in which each entry changed, as the PyTorch
    loop counts them."""
    cfg = SolverConfig(**{"max_iter": 40, "decisions": decisions, **CASES[case]})
    out = both(cfg, torch.float32, quantile=0.0, count_entries=True)
    assert_same(*out)
    assert out[1].entry_iters.shape == out[1].z.shape[:2] and torch.equal(out[0].entry_iters, out[1].entry_iters)


@interpreted
@pytest.mark.parametrize("case", ["converged", "eta_min stall", "patience decays", "check_every 3"])
def test_kernel_the_prefix_rule_and_a_past_prefix_as_the_pytorch_loop(case):
    """Per token, with the tokens before the chunk done from iteration ``prefix`` (cached decoding):
    the same iterates, retirements (``retired_at``, the last token's) and damping as the PyTorch loop."""
    from fpscale.solvers.loop_state import NEVER
    cfg = SolverConfig(**{"max_iter": 40, **CASES[case]})
    prefix = torch.tensor([0, 5, NEVER, 2])
    out = []
    for mode in ("torch", "fused"):
        f, z0 = contraction(torch.float64)
        with torch.no_grad():
            out.append(iterate(f, z0, dataclasses.replace(cfg, bookkeeping=mode), quantile=0.0, prefix=prefix))
    assert_same(*out)
    assert torch.equal(out[0].retired_at, out[1].retired_at), (out[0].retired_at, out[1].retired_at)
    assert int(out[0].retired_at[2]) == NEVER          # a past that never finished holds every token


@interpreted
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_kernel_l2_norm_agrees_to_rounding(dtype):
    a, b = both(SolverConfig(tol=1e-4, norm="l2", freeze_converged=True), dtype)
    assert_same(a, b, exact=False)


@interpreted
@pytest.mark.parametrize("every", [1, 3], ids=["eager", "every3"])
@pytest.mark.parametrize("freeze", [False, True], ids=["nofreeze", "freeze"])
def test_kernel_a_non_finite_residual_stops_where_the_pytorch_loop_stops(every, freeze):
    """Sample 1 goes NaN at the 5th application: both stop 'nonfinite' at iteration 5 with the last
    finite iterate, residuals and damping, however many iterations ran before the read."""
    cfg = SolverConfig(tol=1e-9, max_iter=30, check_every=every, freeze_converged=freeze)
    a, b = both(cfg, torch.float32, bad_at=5)
    assert a.stopped_by == "nonfinite" and a.iterations == 5
    assert torch.isfinite(a.z).all()
    assert_same(a, b)


@interpreted
def test_kernel_left_padding_and_a_bf16_map():
    real = torch.ones(4, 6, dtype=torch.bool)
    real[0, :3] = real[2, :1] = False
    a, b = both(SolverConfig(tol=1e-3, freeze_converged=True), torch.float32, real=real)
    assert_same(a, b)
    assert (a.token_res[~real] == 0).all()
    a, b = both(SolverConfig(tol=2e-2), torch.float32, bf16=True)
    assert_same(a, b)


class Twin:
    """solver.agree: dp as if a second rank saw exactly this rank's samples: the counts doubled."""
    size = 2

    def __call__(self, counts):
        return counts * 2


@interpreted
@pytest.mark.parametrize("bad_at", [None, 4])
def test_kernel_agree_dp_commits_the_groups_decision_as_the_pytorch_loop(bad_at):
    """The fused loop's fifth kernel (``_agreed``) against the PyTorch loop with the same agreement:
    the quantile over 2 x B samples, a non-finite residual seen through the group's count."""
    results = []
    for mode in ("torch", "fused"):
        f, z0 = contraction(torch.float32, bad_at=bad_at)
        with torch.no_grad():
            results.append(iterate(f, z0, SolverConfig(tol=1e-6, max_iter=60, bookkeeping=mode), quantile=0.25,
                                   agree=Twin()))
    assert_same(*results)
    assert results[0].stopped_by == ("quantile" if bad_at is None else "nonfinite")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", TINY + list(VARIANTS))
def test_kernel_every_tiny_config_trains_and_evaluates_the_same(name, dtype):
    """Each tiny config (its own solver settings), one training step (the forward solve and, for the
    implicit backward, the adjoint solve, both fused) and an evaluation: the loss, every gradient
    and every solve's iterations and damping equal the PyTorch loop's."""
    tokens = token_batches(64, n=1, batch=4, seq=17, seed=3)[0]
    runs = []
    for mode in ("torch", "fused"):
        config, extra = VARIANTS.get(name, (name, []))
        cfg = fpscale.load_config(ROOT / "configs" / f"{config}.yaml",
                                  ["model.vocab_size=64", f"solver.execution.bookkeeping={mode}", *extra])
        torch.manual_seed(0)
        model = fpscale.build_model(cfg).to(dtype)
        model.train()
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        stats = {k: (s.iterations, s.stopped_by, s.backward_iterations, s.final_eta.tolist())
                 for k, s in model.solver_stats().items()}
        model.eval()
        with torch.no_grad():
            logits = model(tokens[:, :-1])
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runs.append((loss.detach(), stats, grads, logits, {k: s.iterations for k, s in model.solver_stats().items()}))
    (l0, s0, g0, e0, i0), (l1, s1, g1, e1, i1) = runs
    assert s0 and s0 == s1 and i0 == i1
    assert torch.equal(l0, l1) and torch.equal(e0, e1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@interpreted
def test_kernel_four_kernels_and_one_read_per_iteration():
    """Beside f, an iteration is the 4 kernels (5 per token, the default) and the new iterate's allocation; the
    eager schedule reads once per iteration, tol 0 once per solve; the PyTorch loop's bookkeeping is about 40
    aten ops."""
    per_iteration = {}
    for mode in ("torch", "fused"):
        counts = []
        for cap in (4, 8):
            f, z0 = contraction(torch.float32)
            cfg = SolverConfig(tol=1e-12, max_iter=cap, bookkeeping=mode)
            inner = [0]

            def counted(z, f=f):
                before = ops.total
                out = f(z)
                inner[0] += ops.total - before
                return out
            with torch.no_grad(), count_aten_ops() as ops, count_host_reads() as reads:
                result = iterate(counted, z0, cfg, quantile=0.0)
            assert result.iterations == cap and reads.total == cap
            counts.append(ops.total - inner[0])
        per_iteration[mode] = (counts[1] - counts[0]) / 4
    assert per_iteration["fused"] <= 6, per_iteration
    assert per_iteration["torch"] >= 30, per_iteration
    f, z0 = contraction(torch.float32)
    with torch.no_grad(), count_host_reads() as reads:
        result = iterate(f, z0, SolverConfig(tol=0.0, max_iter=9, eta_min=0.0, bookkeeping="fused"), quantile=0.0)
    assert result.iterations == 9 and reads.total == 1


@interpreted
@pytest.mark.slow
@pytest.mark.multiprocess
def test_kernel_tp2_with_fused_bookkeeping_equals_the_whole_model(tmp_path):
    """tests/parallel/run_tp_model.py with solver.execution.bookkeeping=fused on fpsa (the flags agreed over the TP
    group: consensus) and FP-Mamba (its split state: state_reduce), implicit backward: TP 2 = one process
    in float64 (loss, every gradient, every solve's iterations, forward and adjoint)."""
    os.environ["ONLY"] = "fpsa-implicit,fpmamba-householder-implicit"      # consensus; and a split state
    os.environ["EXTRA"] = "solver.execution.bookkeeping=fused"
    try:
        torchrun(2, "tests/parallel/run_tp_model.py", [str(tmp_path)], timeout=400)
    finally:
        del os.environ["ONLY"], os.environ["EXTRA"]
    assert (tmp_path / "ok").exists()


# ------------------------------------------------------------------- no kernel: the parent's tests
def test_bookkeeping_is_validated_with_its_key():
    with pytest.raises(ConfigError, match=r"solver.execution.bookkeeping.*'auto', 'fused', 'torch'"):
        from_dict(SolverConfig, {"bookkeeping": "triton"}, "solver")
    with pytest.raises(ConfigError, match=r"solver.execution.bookkeeping.*Anderson"):
        fpscale.load_config(None, ["solver.execution.bookkeeping=fused", "solver.forward.anderson=3"])


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernels on CPU")
def test_fused_where_it_cannot_run_is_an_error_and_auto_on_cpu_is_the_pytorch_loop():
    f, z0 = contraction(torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="solver.bookkeeping = fused"):
        iterate(f, z0, SolverConfig(bookkeeping="fused"), quantile=0.0)
    with torch.no_grad(), count_aten_ops() as ops:
        iterate(f, z0, SolverConfig(tol=1e-4), quantile=0.0)
    assert not any(op.startswith("triton.") for op in ops.by_op), ops.by_op


def test_a_feature_the_kernels_lack_runs_the_pytorch_step_and_says_so_once(monkeypatch):
    """Entry groups and a carried state (and, in auto on CUDA, Anderson and sample_l2) are not in the kernels:
    the PyTorch step runs them, the same iterates as bookkeeping: torch, with one warning naming the feature
    (docs/solver.md's mode x feature table); auto on CPU stays silent (it never fuses there)."""
    monkeypatch.setattr(fused, "_warn_fallback_once", functools.cache(fused._warn_fallback_once.__wrapped__))
    f, z0 = contraction(torch.float64)
    with torch.no_grad():
        want = iterate(f, z0, SolverConfig(tol=1e-6, bookkeeping="torch"), quantile=0.0, group=2)
        with pytest.warns(UserWarning, match=r"bookkeeping = fused: the fused kernels have no entry groups of 2"):
            got = iterate(f, z0, SolverConfig(tol=1e-6, bookkeeping="fused"), quantile=0.0, group=2)
            again = iterate(f, z0, SolverConfig(tol=1e-6, bookkeeping="fused"), quantile=0.0, group=2)
        assert torch.equal(want.z, got.z) and torch.equal(got.z, again.z) and want.iterations == got.iterations
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            iterate(f, z0, SolverConfig(tol=1e-6, bookkeeping="fused"), quantile=0.0, group=2)   # once
            assert not fused.fused_wanted(SolverConfig(anderson=3), z0)                            # auto, CPU
        cuda = types.SimpleNamespace(is_cuda=True, device="cuda", numel=z0.numel)
        with pytest.warns(UserWarning, match=r"bookkeeping = auto: .*solver.anderson = 3 / a carried state"):
            assert not fused.fused_wanted(SolverConfig(anderson=3), cuda, carried=True)
    assert fused.unfused_features(SolverConfig(norm="sample_l2", decisions="sample")) == ("solver.norm = sample_l2",)
    assert fused.unfused_features(SolverConfig()) == ()


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="compiles the real kernels (the interpreter replaces them)")
def test_the_kernels_compile_for_an_a100(tmp_path, monkeypatch):
    """The interpreter runs the kernels' Python, not Triton's compiler: every kernel, as launched (each
    specialisation the loop uses, float32 and float64 state, a bf16 f(z)), compiles to a cubin for
    sm_80 with Triton's own ptxas, no GPU needed (sm_90 compiles too: checked once, 9 s more)."""
    arch = 80
    triton_or_skip()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ptr = {"z": "*{s}", "f": "*bf16", "part": "*{s}", "frozen": "*i8", "tres": "*{s}", "real": "*i8", "best": "*{s}",
           "consts": "*{s}", "res": "*{s}", "sres": "*{s}", "flags": "*i64", "patience": "*i64", "eta": "*{s}",
           "eta_out": "*{s}", "alive": "*i32", "first_bad": "*i64", "decision": "*i64", "counts": "*i64", "out": "*{s}",
           "sample": "*i64", "retire": "*i8", "prefix": "*i64", "retired_at": "*i64"}
    launches = [(fused._norms, {"L2": False, "BLOCK_R": 16, "BLOCK_D": 256}),
                (fused._norms, {"L2": True, "BLOCK_R": 16, "BLOCK_D": 256}),
                *[(fused._flags, {"L2": False, "HAS_REAL": True, "BEST": True, "TOKEN": token, "BLOCK_T": 1024})
                  for token in (False, True)],
                (fused._decide, {"PATIENCE": True, "AGREE": False, "BLOCK_B": 8}),
                (fused._decide, {"PATIENCE": False, "AGREE": True, "BLOCK_B": 8}),
                (fused._tokens, {"PATIENCE": True, "HAS_PREFIX": True, "BLOCK_T": 1024}),
                (fused._decide_samples, {"AGREE": True, "BLOCK_B": 8}),
                *[(fused._agreed, {"ETA": eta, "BLOCK_B": 8}) for eta in (False, True)],
                *[(fused._update, {"FREEZE": True, "TOKEN": token, "BLOCK_R": 16, "BLOCK_D": 256})
                  for token in (False, True)]]
    for state in ("fp32", "fp64"):
        for kernel, constexprs in launches:
            signature = {name: ("constexpr" if name in constexprs else
                                ptr[name[:-4]].format(s=state) if name.endswith("_ptr") else "i32")
                         for name in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
            options = {"enable_fp_fusion": False} if kernel is fused._update else {}
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            assert compiled.asm["cubin"], (kernel.__name__, state)
