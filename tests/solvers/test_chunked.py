"""``solver.chunk: K`` (fpscale.solvers.chunked): the chunked loop equals the eager loop (iterates,
iteration counts, stop reasons, damping, losses and gradients, float64), reads the host once per
chunk, and compiles into one graph that no iteration count recompiles.

The semantics tests run the chunk eager (``chunked.COMPILE = False``: the same function, without
Inductor's minutes on a shared CPU); the compiled chunk is checked by the slow tests at the end."""
import math

import pytest
import torch

import fpscale.solvers.chunked as chunked
from fpscale.errors import ConfigError
from fpscale.profiling import count_host_reads
from fpscale.solvers import SolverConfig, solve
from fpscale.solvers.iterate import iterate
from tests.models.helpers import tiny_model, token_batches


@pytest.fixture
def eager_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "COMPILE", False)


def contraction(B=6, T=5, D=4, seed=0, scale=None):
    """A map whose samples and tokens converge at different rates (per-sample contraction)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    s = torch.linspace(0.3, 1.1, B, dtype=torch.float64)[:, None, None] if scale is None else scale
    return lambda z: torch.tanh(s * (z @ W) + x), torch.zeros(B, T, D, dtype=torch.float64)


CASES = {
    "quantile": dict(tol=1e-6, stop_quantile=0.25),
    "all": dict(tol=1e-6, stop_quantile=0.0, max_iter=40),
    "freeze": dict(tol=1e-4, freeze_converged=True, stop_quantile=0.0),
    "patience": dict(tol=1e-9, patience=2, decay=0.5, eta_min=0.05, max_iter=60),
    "best_l2": dict(tol=1e-5, stop_residual="best", norm="l2", damping=0.8),
    "cap": dict(tol=0.0, max_iter=7),
    "half": dict(tol=1e-3, stop_quantile=0.5),
    "sample_freeze": dict(decisions="sample", tol=1e-4, freeze_converged=True, stop_quantile=0.0),
    "sample_patience": dict(decisions="sample", tol=1e-9, patience=2, decay=0.5, eta_min=0.05, max_iter=60),
}


@pytest.mark.parametrize("K", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loop_equals_the_eager_loop(case, K, eager_chunks):
    f, z0 = contraction()
    cfg = SolverConfig(**CASES[case])
    for training in (True, False):
        a, sa = solve(f, z0, cfg, training=training)
        b, sb = solve(f, z0, SolverConfig(**CASES[case], chunk=K), training=training)
        assert (sb.iterations, sb.stopped_by) == (sa.iterations, sa.stopped_by)
        assert torch.equal(b, a)
        assert torch.equal(sb.final_eta, sa.final_eta) and torch.equal(sb.token_converged, sa.token_converged)
        assert torch.equal(sb.sample_residual, sa.sample_residual)


def test_padding_and_carry_as_eager(eager_chunks):
    f, z0 = contraction()
    real = torch.ones(z0.shape[:2], dtype=torch.bool)
    real[1, :2] = False
    cfg = SolverConfig(tol=1e-5, freeze_converged=True, patience=2, decay=0.5)
    first = iterate(f, z0, cfg, quantile=0.0, max_iter=4, real=real)
    a = iterate(f, first.z, cfg, quantile=0.0, max_iter=9, real=real, carry=first.carry)
    firstc = chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 3}), quantile=0.0, max_iter=4, real=real)
    b = chunked.run_loop(f, firstc.z, SolverConfig(**{**vars(cfg), "chunk": 3}), quantile=0.0, max_iter=9, real=real,
                         carry=firstc.carry)
    assert torch.equal(firstc.z, first.z) and (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by)
    assert torch.equal(b.z, a.z) and torch.equal(b.carry.frozen, a.carry.frozen)
    assert torch.equal(b.carry.patience_left, a.carry.patience_left) and torch.equal(b.carry.best, a.carry.best)


def test_nonfinite_residual_stops_where_eager_stops(eager_chunks):
    calls = {"n": 0}

    def f(z):
        calls["n"] += 1
        out = 0.5 * z + 1
        return out * float("nan") if calls["n"] == 5 else out
    z0 = torch.zeros(2, 3, 2, dtype=torch.float64)
    a, sa = solve(f, z0, SolverConfig(tol=1e-12, max_iter=20), training=True)
    calls["n"] = 0
    b, sb = solve(f, z0, SolverConfig(tol=1e-12, max_iter=20, chunk=3), training=True)
    assert (sb.iterations, sb.stopped_by) == (sa.iterations, sa.stopped_by) == (5, "nonfinite")
    assert torch.equal(b, a) and torch.isfinite(b).all()


@pytest.mark.parametrize("K", [2, 5])
def test_one_host_read_per_chunk(K, eager_chunks):
    f, z0 = contraction(scale=torch.linspace(0.05, 0.4, 6, dtype=torch.float64)[:, None, None])
    cfg = SolverConfig(tol=1e-6, stop_quantile=0.0, max_iter=40, chunk=K)
    with count_host_reads() as reads:
        _, stats = solve(f, z0, cfg, training=False)
    assert 5 < stats.iterations < 40 and stats.stopped_by == "converged"
    assert reads.total == math.ceil(stats.iterations / K), reads.by_method


def test_bad_chunk_settings_name_the_key():
    with pytest.raises(ConfigError, match="chunk"):
        SolverConfig(chunk=-1).validate()
    SolverConfig(chunk=4, anderson=3).validate()     # Anderson chunks now (tests/solvers/test_one_loop.py)


# ------------------------------------------------------------------ tiny models, every backward mode
SOLVER = {"tol": 1e-3, "max_iter": 12, "stop_quantile": 0.25, "patience": 2, "decay": 0.6,
          "backward_tol": 1e-6, "backward_max_iter": 15}


def step_of(kind: str, backward: str, chunk: int, **spec):
    model = tiny_model(kind, dtype=torch.float64, solver={**SOLVER, "backward": backward, "chunk": chunk,
                                                          "freeze_converged": kind == "fpsa"}, **spec)
    model.train()
    x = token_batches(32, n=1, batch=4, seq=12)[0]
    with count_host_reads() as reads:
        loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
    (stats,) = model.solver_stats().values()
    return loss.detach(), [p.grad for p in model.parameters()], stats, reads.total


QUICK = {("fpsa", "implicit"), ("fpmamba", "jfb"), ("fpmamba2", "unroll"), ("looped", "phantom")}


@pytest.mark.parametrize("kind,backward", [
    pytest.param(k, b, marks=() if (k, b) in QUICK else pytest.mark.slow)
    for k in ("fpsa", "fpmamba", "fpmamba2", "looped") for b in ("implicit", "phantom", "jfb", "unroll")])
def test_tiny_models_train_as_eager_in_float64(kind, backward, eager_chunks):
    la, ga, sa, ra = step_of(kind, backward, 0)
    lb, gb, sb, rb = step_of(kind, backward, 4)
    assert (sb.iterations, sb.stopped_by, sb.backward_iterations) == \
        (sa.iterations, sa.stopped_by, sa.backward_iterations)
    torch.testing.assert_close(lb, la, rtol=1e-12, atol=0)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)
    solves = [sb.iterations] + ([sb.backward_iterations] if sb.backward_iterations is not None else [])
    assert rb == sum(math.ceil(n / 4) for n in solves) + (ra - sum(solves)), (ra, rb, sb)


# ------------------------------------------------------------------------------ compiled: one graph
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fpsa", "fpsa_frozen", "fpmamba", "fpmamba2", "looped"])
def test_compiled_chunk_has_no_graph_break_and_no_recompilation(kind, monkeypatch):
    """Evaluation solves (no grad) at 5 depths: 1 to 4 chunks of 4, the last one cut by the cap: one
    graph, compiled once, no break, no recompilation; as the eager chunk computes. ``fpsa_frozen``:
    freezing on, so the chunk's state carries fpsa's per-entry counts (``count_entries``: a tensor of one
    shape, no recompilation per chunk), counting as the eager loop does. Graph breaks and
    recompilations are dynamo's: the aot_eager backend counts them without Inductor's C++ build
    (the Inductor-compiled chunk: test_compiled_chunks_train_as_eager, bench/compile_counts.py)."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(chunked, "BACKEND", "aot_eager")
    frozen = kind == "fpsa_frozen"
    model = tiny_model("fpsa" if frozen else kind,
                       solver={"tol": 0.0, "max_iter": 13, "chunk": 4, "freeze_converged": frozen}).eval()
    x = token_batches(32, n=1, batch=2, seq=8)[0]
    torch._dynamo.reset()
    counters.clear()
    seen = []
    with torch.no_grad():
        for depth in (3, 5, 8, 11, 13):
            with model.eval_depth(depth):
                out = model(x)
            (stats,) = model.solver_stats().values()
            seen.append(stats.iterations)
            chunked.COMPILE = False
            try:
                with model.eval_depth(depth):
                    torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
                (eager,) = model.solver_stats().values()
                if frozen:          # entries stop changing at different steps (float32 stagnation)
                    assert torch.equal(stats.entry_iterations, eager.entry_iterations)
            finally:
                chunked.COMPILE = True
    assert seen == [3, 5, 8, 11, 13]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])


def test_fpsa_per_head_entries_as_eager(eager_chunks):
    """fpsa with ``halting: head``: several state entries per token (the loop's ``group``)."""
    la, ga, sa, _ = step_of("fpsa", "implicit", 0, halting="head")
    lb, gb, sb, _ = step_of("fpsa", "implicit", 3, halting="head")
    assert (sb.iterations, sb.stopped_by, sb.backward_iterations) == \
        (sa.iterations, sa.stopped_by, sa.backward_iterations)
    torch.testing.assert_close(lb, la, rtol=1e-12, atol=0)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("decisions", ["token", "sample"])
def test_min_iter_and_prefix_as_eager(decisions, eager_chunks):
    """Cached decoding's arguments: no stop before min_iter; the tokens before the chunk done from
    ``prefix`` on (the prefix rule); ``retired_at`` as the eager loop reports it."""
    f, z0 = contraction(scale=torch.linspace(0.05, 0.4, 6, dtype=torch.float64)[:, None, None])
    cfg = SolverConfig(tol=1e-3, decisions=decisions, freeze_converged=True, stop_quantile=0.0)
    prefix = torch.tensor([0, 3, 5, 9, 2, 4])
    a = iterate(f, z0, cfg, quantile=0.0, max_iter=20, min_iter=11, prefix=prefix)
    b = chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 4}), quantile=0.0, max_iter=20, min_iter=11,
                         prefix=prefix)
    assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by) and a.iterations == 11
    assert torch.equal(b.z, a.z) and torch.equal(b.retired_at, a.retired_at) and torch.equal(b.eta, a.eta)


@pytest.mark.slow
def test_compiled_chunks_train_as_eager(monkeypatch):
    """fpsa with the implicit backward, compiled: the forward solve in the compiled chunk, the adjoint
    (an autograd.grad step, which does not trace as one graph) said once and chunked eager; loss,
    gradients and counts as the eager loop's (float64, to rounding: Inductor fuses the bookkeeping)."""
    monkeypatch.setattr(chunked, "_UNTRACEABLE", set())
    la, ga, sa, _ = step_of("fpsa", "implicit", 0)
    with pytest.warns(UserWarning, match="does not trace as one graph"):
        lb, gb, sb, _ = step_of("fpsa", "implicit", 4)
    assert (sb.iterations, sb.stopped_by, sb.backward_iterations) == \
        (sa.iterations, sa.stopped_by, sa.backward_iterations)
    torch.testing.assert_close(lb, la, rtol=1e-10, atol=0)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-12)


def test_compiled_chunk_graph_holds_no_uint8(monkeypatch):
    """The chunk's graph as dynamo hands it to the compiler holds no uint8 tensor: on the first GPU run
    (torch 2.11, Triton 3.6) Inductor built a uint8 constant -1 for the prefix rule's cummin and Triton
    refused it, so no chunk compiled there. Device-independent: the graph is the same on CPU; the
    bookkeeping is every layer type's (fpscale.solvers.iterate), traced here inside fpsa's chunk."""
    seen: set = set()

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            val = node.meta.get("example_value")
            for t in (val if isinstance(val, (tuple, list)) else (val,)):
                if isinstance(t, torch.Tensor):
                    seen.add(t.dtype)
        return gm.forward
    monkeypatch.setattr(chunked, "BACKEND", record)
    model = tiny_model("fpsa", solver={"tol": 1e-3, "max_iter": 8, "chunk": 4}).eval()
    x = token_batches(32, n=1, batch=2, seq=8)[0]
    torch._dynamo.reset()
    with torch.no_grad():
        model(x)
    assert torch.bool in seen and torch.long in seen, seen       # the chunk was traced
    assert torch.uint8 not in seen, seen
