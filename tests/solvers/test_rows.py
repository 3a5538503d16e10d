"""Row compaction in the eager loop (fpscale.solvers.rows): f offering ``rows(index)`` runs on the rows not yet
done, and the solve's output and statistics are those of the solve over every row.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python -m pytest -q -n 0 tests/solvers/test_rows.py
"""
import pytest
import torch

from fpscale.layers.step_cache import StepCache, along
from fpscale.solvers import SolverConfig, chunked, solve
from fpscale.solvers.rows import RowCompaction

# rows 0..7: contraction 0.05 .. 0.9, so row b converges at an iteration growing with b
A = torch.linspace(0.05, 0.9, 8)


def row_map(calls: list):
    """z -> a_b tanh(z W) + x_b per row b, elementwise per row (a row's result does not depend on the others);
    ``calls`` records the rows of every call (restricted or not)."""
    W = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))[0]
    x = torch.randn(8, 1, 6, generator=torch.Generator().manual_seed(1))

    def on(index):
        a, xs = A[index, None, None], x[index]

        def f(z):
            calls.append(index.tolist())
            return a * torch.tanh(z @ W) + xs
        return f
    everything = on(torch.arange(8))

    def f(z):
        return everything(z)
    f.rows = on         # type: ignore[attr-defined]
    return f, torch.zeros_like(x)


def plain(f):
    """The same map without ``rows``: no compaction."""
    def g(z):
        return f(z)
    return g


@pytest.mark.parametrize("anderson", [0, 3])
def test_a_compacted_solve_equals_the_solve_over_every_row_and_computes_fewer_rows(anderson):
    cfg = SolverConfig(tol=1e-6, eval_max_iter=200, anderson=anderson)
    calls: list = []
    f, z0 = row_map(calls)
    with torch.no_grad():
        ref, ref_stats = solve(plain(f), z0, cfg, training=False, count_entries=True)
        calls.clear()
        z, stats = solve(f, z0, cfg, training=False, count_entries=True)
    assert torch.allclose(z, ref, rtol=0, atol=1e-6), float((z - ref).abs().max())
    assert stats.iterations == ref_stats.iterations and stats.stopped_by == ref_stats.stopped_by == "converged"
    assert torch.equal(stats.token_converged, ref_stats.token_converged)
    assert torch.equal(stats.retired_at, ref_stats.retired_at)            # per row, as without compaction
    assert torch.equal(stats.entry_iterations, ref_stats.entry_iterations)
    assert stats.final_eta.shape == ref_stats.final_eta.shape and stats.sample_residual.shape == (8,)
    assert ref_stats.row_iterations == 8 * ref_stats.iterations
    assert stats.row_iterations == sum(len(c) for c in calls) < ref_stats.row_iterations
    # each restriction at most half the rows of the one before, and never a row that is still running dropped
    sizes = sorted({len(c) for c in calls}, reverse=True)
    assert sizes[0] == 8 and len(sizes) > 1 and all(b <= a // 2 for a, b in zip(sizes, sizes[1:]))


def exact_decode(compact: bool, anderson: int):
    """One new token per row solved against an ``exact`` decoding cache (fpscale.layers.step_cache), as a layer
    does: f reads the past's entry j at its call j and records its own; the past of row b changes until its
    ``prefix`` (iteration 1 .. 5) and is constant after, as a cache the prefix rule wrote is. The map is
    elementwise (z, p -> a_b (z + p) / (1 + |z + p|) + x_b), so its rows are the same bit for bit whatever
    rows it runs on. Returns (z, stats, the cache after ``store``)."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.tensor([1, 2, 3, 5, 5, 4, 2, 1])
    past = torch.randn(8, 6, 2, 6, generator=g)             # [B, J entries, 2 past tokens, D]
    for b, j in enumerate(prefix.tolist()):
        past[b, j:] = past[b, j]
    x = torch.randn(8, 1, 6, generator=g)
    cache = {"steps": {"iters": {"p": past}, "finals": {"p": past[:, -1:]}, "mode": "exact", "prefix": prefix}}
    steps = StepCache(cache)

    def map_of(steps, index):
        a, xs = A[index, None, None], x[index]

        def f(z):
            u = z + steps.past("p")[:, -1:]
            steps.record(p=z * 0.5 + u)
            return a * u / (1 + u.abs()) + xs
        return f
    f = map_of(steps, torch.arange(8))
    if compact:
        f.rows = lambda index: map_of(steps.rows(index), index)       # type: ignore[attr-defined]
    cfg = SolverConfig(tol=1e-6, eval_max_iter=200, anderson=anderson)
    with torch.no_grad():
        z, stats = solve(f, torch.zeros_like(x), cfg, training=False, prefix=steps.prefix, min_iter=steps.min_iter,
                         on_final=steps.on_final, count_entries=True)
        if not steps.finals:
            f(z)
    steps.retired_at = stats.retired_at
    steps.store(cache, {"p": along(1)})
    return z, stats, cache["steps"]


@pytest.mark.parametrize("anderson", [0, 3])
def test_exact_cache_rows_leave_once_their_entries_no_longer_change(anderson):
    """``exact`` decoding's compaction: a row leaves the iteration it froze (at or after its prefix: from there
    neither its iterate nor the past it reads changes), and at the calls it missed ``store`` gives it its entries
    of z*; the solve and the whole cache equal the uncompacted ones bit for bit."""
    ref, ref_stats, ref_cache = exact_decode(False, anderson)
    z, stats, cache = exact_decode(True, anderson)
    assert torch.equal(z, ref)
    assert stats.iterations == ref_stats.iterations and stats.stopped_by == ref_stats.stopped_by == "converged"
    assert torch.equal(stats.retired_at, ref_stats.retired_at)
    assert torch.equal(stats.entry_iterations, ref_stats.entry_iterations)
    assert (stats.retired_at >= torch.tensor([1, 2, 3, 5, 5, 4, 2, 1])).all()      # the prefix rule
    for part in ("iters", "finals"):
        assert torch.equal(cache[part]["p"], ref_cache[part]["p"]), part
    assert torch.equal(cache["prefix"], ref_cache["prefix"])
    assert stats.row_iterations < ref_stats.row_iterations == 8 * ref_stats.iterations


@pytest.mark.parametrize("setting", [{"decisions": "sample"}, {"check_every": 2}, {"chunk": 2}])
def test_outside_the_rule_f_runs_on_every_row(setting, monkeypatch):
    """Sample decisions, check_every and compiled chunks keep f on the whole batch (static shapes)."""
    monkeypatch.setattr(chunked, "COMPILE", False)       # the chunk's semantics, without Inductor
    cfg = SolverConfig(tol=1e-6, eval_max_iter=200, **setting)
    calls: list = []
    f, z0 = row_map(calls)
    with torch.no_grad():
        z, stats = solve(f, z0, cfg, training=False)
    assert {len(c) for c in calls} == {8}
    assert stats.row_iterations == 8 * stats.iterations


def test_no_compaction_under_grad():
    cfg = SolverConfig(tol=1e-6, eval_max_iter=200, backward="unroll")
    calls: list = []
    f, z0 = row_map(calls)
    solve(f, z0.requires_grad_(), cfg, training=True)
    assert {len(c) for c in calls} == {8}


def test_shrink_waits_until_at_most_half_the_rows_are_active():
    rows = RowCompaction(lambda z: z, keep_last_f=False)
    rows.f.rows = lambda index: (lambda z: z)          # type: ignore[attr-defined]
    active = torch.tensor([True, True, True, False, False, True, False, False])
    rows.shrink(active[:5].clone().index_fill_(0, torch.tensor([3]), True), 4)    # 4 of 5: no
    assert rows.index is None
    rows.shrink(active, 4)                                                       # 4 of 8: yes
    assert rows.index.tolist() == [0, 1, 2, 5] and rows.compactions == 1
    rows.shrink(active.index_fill(0, torch.tensor([5]), False), 3)                # 3 of 4: no
    assert rows.compactions == 1
