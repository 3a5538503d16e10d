"""One iteration (fpscale.solvers.step.advance), every execution mode: the eager loop, ``check_every: N``, the
chunk of K (run eager here; compiled in the slow test) give the same
iterates, damping, residuals, iteration counts and stop reasons in float64, for every feature the shipped
configs use, Anderson mixing (both variants) and ``sample_l2`` included. The fused bookkeeping is held to the
same step by tests/solvers/test_fused.py (its kernel tests, under Triton's interpreter).

``check_every: N`` stops at the first read iteration whose decision stops: it is compared with the eager
loop held to that many iterations (``min_iter`` = ``max_iter`` = its count: the same iterates up to there,
the same decision at its last)."""
import dataclasses

import pytest
import torch

import fpscale.solvers.chunked as chunked
from fpscale.solvers import SolverConfig
from tests.models.helpers import tiny_model, token_batches
from tests.solvers.test_chunked import CASES, contraction

FEATURES = {
    **CASES,
    "anderson_token": dict(tol=1e-8, anderson=3, stop_quantile=0.0, max_iter=30),
    "anderson_sample": dict(tol=1e-8, anderson=4, decisions="sample", damping=0.9, max_iter=30),
    "anderson_freeze": dict(tol=1e-5, anderson=3, decisions="sample", freeze_converged=True, stop_quantile=0.0),
    "anderson_wraps": dict(tol=0.0, anderson=2, max_iter=9, eta_min=0.0),
    "attractor": dict(tol=1e-5, anderson=5, anderson_variant="attractor", norm="sample_l2", decisions="sample",
                      stop_quantile=0.0, min_iter=4, patience=0, eta_min=0.0, max_iter=24),
    "attractor_short_cap": dict(tol=1e-7, anderson=5, anderson_variant="attractor", norm="sample_l2",
                                decisions="sample", max_iter=2),
    "sample_l2": dict(tol=1e-4, norm="sample_l2", decisions="sample", stop_quantile=0.25),
    "tiny_attractor": dict(max_iter=24, min_iter=4, tol=3e-3, norm="l2", stop_quantile=0.0, patience=0, eta_min=0.0,
                           anderson=5, anderson_lambda=1e-4),
}
MODES = {"chunk_3": dict(chunk=3), "chunk_1": dict(chunk=1), "check_every_3": dict(check_every=3)}


def run(cfg: SolverConfig, training: bool, fast: bool = False, **kw):
    f, z0 = contraction(scale=torch.linspace(0.05, 0.6, 6, dtype=torch.float64)[:, None, None] if fast else None)
    real = torch.ones(z0.shape[:2], dtype=torch.bool)
    real[:2, :2] = False                                  # left padding: residual 0, never holds a solve up
    quantile = cfg.stop_quantile if training else 0.0
    return chunked.run_loop(f, z0, cfg, quantile=quantile, real=real, **kw)


def same(a, b):
    assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by)
    for name in ("z", "eta", "token_res", "retired_at"):
        assert torch.equal(getattr(b, name), getattr(a, name)), name


@pytest.mark.parametrize("fast", [False, True], ids=["slow_map", "fast_map"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_mode_runs_the_same_iterations(feature, mode, fast, monkeypatch):
    """Two maps: one whose slowest samples reach the cap in most cases, one where every stop rule fires."""
    monkeypatch.setattr(chunked, "COMPILE", False)
    cfg = SolverConfig(**FEATURES[feature])
    cfg.validate()
    other = dataclasses.replace(cfg, **MODES[mode])
    for training in (True, False):
        b = run(other, training, fast)
        if mode.startswith("check_every"):
            a = run(cfg, training, fast, min_iter=b.iterations, max_iter=b.iterations)
        else:
            a = run(cfg, training, fast)
        same(a, b)


def anderson_step(chunk: int, decisions: str = "token"):
    solver = {"max_iter": 12, "min_iter": 2, "tol": 1e-6, "norm": "l2" if decisions == "token" else "sample_l2",
              "decisions": decisions, "stop_quantile": 0.0, "patience": 0, "eta_min": 0.0, "anderson": 5,
              "anderson_variant": "fpscale" if decisions == "token" else "attractor", "backward": "neumann1",
              "mask_unconverged": False, "chunk": chunk}
    model = tiny_model("attractor", dtype=torch.float64, solver=solver).train()
    x = token_batches(32, n=1, batch=2, seq=8)[0]
    loss = model(x[:, :-1], targets=x[:, 1:])
    loss.backward()
    (stats,) = model.solver_stats().values()
    return loss.detach(), [p.grad for p in model.parameters()], stats


@pytest.mark.parametrize("decisions", [pytest.param("token", marks=pytest.mark.slow), "sample"])
def test_attractor_layer_trains_chunked_as_eager(decisions, monkeypatch):
    """The Attractor layer (Anderson; per token as tiny_attractor, or per sample with sample_l2 and the
    attractor variant as their solver): a training step chunked equals the eager one, float64."""
    monkeypatch.setattr(chunked, "COMPILE", False)
    la, ga, sa = anderson_step(0, decisions)
    lb, gb, sb = anderson_step(4, decisions)
    assert (sb.iterations, sb.stopped_by) == (sa.iterations, sa.stopped_by)
    torch.testing.assert_close(lb, la, rtol=1e-12, atol=0)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("decisions", ["token", "sample"])
def test_anderson_chunk_compiles_as_one_graph(decisions, monkeypatch):
    """Anderson mixing and sample_l2 inside the compiled chunk: one graph, no break, no recompilation over
    solves of different depths; the values as the eager chunk's (dynamo's counts, aot_eager backend)."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(chunked, "BACKEND", "aot_eager")
    f, z0 = contraction()
    cfg = SolverConfig(**FEATURES["attractor" if decisions == "sample" else "anderson_token"], chunk=4)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for cap in (3, 9, 14):
            b = chunked.run_loop(lambda z: f(z), z0, cfg, quantile=0.0, max_iter=cap)
            monkeypatch.setattr(chunked, "COMPILE", False)
            a = chunked.run_loop(f, z0, cfg, quantile=0.0, max_iter=cap)
            monkeypatch.setattr(chunked, "COMPILE", True)
            assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by)
            torch.testing.assert_close(b.z, a.z, rtol=1e-12, atol=1e-14)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])


@pytest.mark.parametrize("expect_shift", [-3, 0, 4])
def test_expected_schedule_reads_once_where_the_solve_takes_what_it_took(expect_shift, monkeypatch):
    """``chunk_schedule: expected`` with a chunk of 1: the chunks covering the expected iterations run before
    the first read. The result is the eager loop's whatever the expectation; the reads are 1 where the solve
    takes what was expected (or fewer), one more per iteration beyond it; the applications of f are the
    iterations taken where the expectation is not above them (no masked iteration after the stop)."""
    from fpscale.profiling import count_host_reads
    monkeypatch.setattr(chunked, "COMPILE", False)
    f, z0 = contraction()
    cfg = SolverConfig(**FEATURES["half"], max_iter=60)
    a = chunked.run_loop(f, z0, cfg, quantile=0.5)
    assert a.stopped_by == "quantile" and a.iterations + 4 < 60
    calls = []

    def counted(z):
        calls.append(1)
        return f(z)

    expect = a.iterations + expect_shift
    with count_host_reads() as reads:
        b = chunked.run_loop(counted, z0, dataclasses.replace(cfg, chunk=1, chunk_schedule="expected"),
                             quantile=0.5, expect=expect)
    same(a, b)
    assert reads.total == 1 + max(0, -expect_shift)
    assert len(calls) == max(a.iterations, expect)


@pytest.mark.parametrize("mode", ["eager", *MODES])
@pytest.mark.parametrize("feature", ["freeze", "sample_freeze", "all", "cap", "anderson_freeze"])
def test_per_entry_counts_are_the_steps_each_entry_changed_in_every_mode(feature, mode, monkeypatch):
    """``count_entries`` (fpsa's per-head iterations): the solver's count per entry is the number of steps in
    which that entry of the iterate changed, recounted here from the iterates f received and the result, and
    equal in every mode."""
    monkeypatch.setattr(chunked, "COMPILE", False)
    f, z0 = contraction()
    seen = []

    def recording(z):
        seen.append(z.clone())
        return f(z)
    cfg = SolverConfig(**FEATURES[feature], **MODES.get(mode, {}))
    with torch.no_grad():
        out = chunked.run_loop(recording, z0, cfg, quantile=0.0, count_entries=True)
    iterates = [*seen, out.z]
    recount = sum((b != a).any(-1).int() for a, b in zip(iterates, iterates[1:]))
    assert out.entry_iters.dtype == torch.int32 and torch.equal(out.entry_iters, recount)
    if "freeze" in feature:                      # entries froze at different steps
        assert out.entry_iters.unique().numel() > 1
    eager = chunked.run_loop(f, z0, SolverConfig(**FEATURES[feature]), quantile=0.0, count_entries=True)
    if mode == "check_every_3":       # it may read (and stop) later: the counts of an entry can only grow
        assert bool((out.entry_iters >= eager.entry_iters).all())
    else:
        assert torch.equal(out.entry_iters, eager.entry_iters)
    assert chunked.run_loop(f, z0, cfg, quantile=0.0).entry_iters is None          # not asked: not counted
