"""Host reads of the solver (issue 27): none inside a solve when no stop rule can fire (tol 0),
at most one per iteration with a live stop, one per N iterations with ``check_every: N``, whose
iterates are the eager solve's; solver statistics reach the host in one read per log step.

Reads are counted by patching the tensor-to-host methods (fpscale.profiling): on a CPU
``.cpu()`` and ``.tolist()`` are cheap, but each is a synchronisation on a GPU."""
import math

import pytest
import torch

import fpscale.solvers.iterate as iterate_module
from fpscale.errors import ConfigError
from fpscale.profiling import count_aten_ops, count_host_reads
from fpscale.solvers import SolverConfig, solve
from fpscale.solvers.iterate import StopFlags, read_schedule
from fpscale.solvers.stats import to_dicts
from fpscale.train.trainer import as_dicts, collect_layer_stats
from fpscale.typed import from_dict
from tests.models.helpers import tiny_model, token_batches

KINDS = ["fpsa", "fpmamba", "looped"]
LIVE = {"tol": 2e-2, "stop_quantile": 0.25, "max_iter": 16, "backward_tol": 1e-3, "backward_max_iter": 20}
# the seeds' per-sample rule without freezing: a solve stopped at K is then a tol-0 solve capped at K
# (per token, the default, converged tokens retire, and a tol-0 solve retires none)
SAMPLE = {"decisions": "sample"}
FIXED = {"tol": 0.0, "max_iter": 8, "backward_tol": 0.0, "backward_max_iter": 8}


def train_step(kind: str, solver: dict, autocast: bool = False, batch: int = 4, seed: int = 0):
    """One forward + backward of a tiny model; the host reads it made, its solver statistics."""
    model = tiny_model(kind, seed=seed, solver=solver)
    model.train()
    x = token_batches(32, n=1, batch=batch, seq=24, seed=seed)[0]
    with count_host_reads() as reads:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
    (stats,) = model.solver_stats().values()
    return reads, stats, model


def solves(stats) -> int:
    return 1 + (stats.backward_iterations is not None)


# ---------------------------------------------------------------------------------- tol 0: none
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backward", ["implicit", "jfb", "unroll"])
@pytest.mark.parametrize("kind", KINDS)
def test_tol_0_reads_nothing_inside_a_solve(kind, backward, autocast):
    """A fixed depth (tol 0, as Huginn and Parcae train): the cap runs in the forward and in the
    adjoint with one read at the end of each solve (non-finite or not), none per iteration."""
    reads, stats, _ = train_step(kind, {**FIXED, "backward": backward}, autocast)
    assert stats.iterations == 8 and stats.stopped_by == "max_iter"
    if backward == "implicit":
        assert stats.backward_iterations == 8
    assert reads.total == solves(stats), (reads.by_method, stats)


def test_no_rule_can_fire_exactly_when_tol_is_0_and_eta_min_is_out_of_reach():
    cfg = SolverConfig(tol=0.0, damping=1.0, patience=5, decay=0.7, eta_min=0.05)   # 9 decays x 5
    assert read_schedule(cfg, 44) is None and read_schedule(cfg, 45) == 1
    assert read_schedule(SolverConfig(tol=0.0, patience=0), 10_000) is None
    assert read_schedule(SolverConfig(tol=0.0, eta_min=0.0), 10_000) is None
    assert read_schedule(SolverConfig(tol=1e-3), 1) == 1
    assert read_schedule(SolverConfig(tol=1e-3, check_every=4), 30) == 4


def test_an_eta_min_stop_in_reach_keeps_the_reads():
    """tol 0 but the damping can decay below eta_min within the cap: the eta_min rule is live."""
    cfg = SolverConfig(max_iter=100, tol=0.0, damping=1.0, patience=2, decay=0.5, eta_min=0.1)
    with count_host_reads() as reads:
        _, stats = solve(lambda z: 2 * z, torch.ones(1, 1, 2), cfg, training=False)
    assert stats.stopped_by == "eta_min" and stats.iterations == 9 and reads.total == 9


# ---------------------------------------------------------------------------- live stop: <= 1/it
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_live_stop_reads_once_per_iteration(kind, autocast):
    reads, stats, _ = train_step(kind, LIVE, autocast)
    assert reads.total == stats.iterations + (stats.backward_iterations or 0), (reads.by_method, stats)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_check_every_reads_every_nth_iteration(kind, autocast):
    n = 4
    reads, stats, _ = train_step(kind, {**LIVE, "check_every": n}, autocast)
    eager_reads, eager, _ = train_step(kind, LIVE, autocast)
    # the forward stops at the first multiple of n at or after the eager stop (or the cap)
    assert stats.iterations == min(math.ceil(eager.iterations / n) * n, 16)
    expected = math.ceil(stats.iterations / n) + math.ceil((stats.backward_iterations or 0) / n)
    assert reads.total == expected <= eager_reads.total, (reads.by_method, stats)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_check_every_forward_equals_a_fixed_depth_of_its_iteration_count(kind, autocast):
    """The layer's output after check_every's K iterations is bit for bit the output of a solve
    run to the cap K with tol 0 (the iterations between reads are the eager loop's)."""
    def run(solver: dict):
        model = tiny_model(kind, solver=solver)
        model.train()
        x = token_batches(32, n=1, batch=4, seq=24)[0]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.hidden(x)
        (stats,) = model.solver_stats().values()
        return out, stats.iterations

    out, k = run({**LIVE, **SAMPLE, "check_every": 3})
    fixed, k_fixed = run({**LIVE, **SAMPLE, "tol": 0.0, "max_iter": k})
    assert k % 3 == 0 and k_fixed == k and torch.equal(out, fixed)


# ------------------------------------------------------------- check_every at the solver level
def contraction(dtype, seed=0, B=6, T=5, D=8):
    g = torch.Generator().manual_seed(seed)
    W = (0.9 * torch.randn(D, D, generator=g) / D ** 0.5).to(dtype)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    scale = torch.linspace(0.3, 1.6, B, dtype=dtype).view(B, 1, 1)   # some samples converge slowly
    seen = []

    def f(z):
        seen.append(z.detach().clone())
        return torch.tanh(scale * (z @ W) + x)
    return f, torch.zeros(B, T, D, dtype=dtype), seen


def force_eager(monkeypatch):
    monkeypatch.setattr(iterate_module, "read_schedule", lambda cfg, cap: 1)


@pytest.mark.parametrize("freeze", [False, True, "token"])
@pytest.mark.parametrize("anderson", [0, 3])
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_check_every_iterates_are_the_eager_ones(dtype, n, anderson, freeze, monkeypatch):
    """Up to the eager stop the iterates are the eager solve's; after it, check_every runs at
    most n - 1 further iterations (to the next multiple of n) and reports them. Without freezing
    its result equals a tol-0 solve capped at that count, by the no-read path and by the eager
    loop alike. ``freeze`` "token": the per-token rule (``decisions: token``, which retires converged
    tokens), whose deferred reads take the same iterates as its eager loop."""
    tol = 1e-5 if dtype == torch.float64 else 1e-4
    # (per token under Anderson mixing each token's residual zigzags, and patience 2 decays its
    # damping until the hardest sample stalls: this map hits the cap at 60, per sample 24 iterations)
    patience = 0 if freeze == "token" and anderson else 2
    base = dict(max_iter=60, tol=tol, stop_quantile=0.25, damping=0.9, patience=patience, decay=0.8,
                eta_min=1e-4, anderson=anderson, freeze_converged=freeze is True,
                decisions="token" if freeze == "token" else "sample")
    f, z0, seen = contraction(dtype)
    z_eager, eager = solve(f, z0, SolverConfig(**base), training=True)
    eager_seen = list(seen)
    seen.clear()
    with count_host_reads() as reads:
        z_every, every = solve(f, z0, SolverConfig(**base, check_every=n), training=True)
    assert eager.stopped_by in ("quantile", "converged")
    # the first read at or after the eager stop; later if the rule no longer holds there (a
    # sample's residual may rise again under Anderson mixing)
    assert every.iterations % n == 0 and every.iterations >= eager.iterations
    if anderson == 0:
        assert every.iterations == min(math.ceil(eager.iterations / n) * n, 60)
    assert every.stopped_by in ("quantile", "converged")
    assert reads.total == math.ceil(every.iterations / n)
    assert len(seen) == every.iterations
    for a, b in zip(eager_seen, seen):
        assert torch.equal(a, b)
    if every.iterations == eager.iterations:
        assert torch.equal(z_every, z_eager)
    if freeze:
        return
    fixed = SolverConfig(**{**base, "tol": 0.0, "max_iter": every.iterations})
    z_fixed, st = solve(f, z0, fixed, training=True)
    assert st.iterations == every.iterations and torch.equal(z_fixed, z_every)
    force_eager(monkeypatch)
    z_loop, st = solve(f, z0, fixed, training=True)
    assert st.iterations == every.iterations and torch.equal(z_loop, z_every)
    assert torch.equal(st.final_eta, every.final_eta)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_tol_0_equals_the_eager_loop(dtype, monkeypatch):
    """The no-read path computes what the per-iteration loop computes (iterate, damping, residuals)."""
    cfg = SolverConfig(max_iter=12, tol=0.0, damping=0.8, patience=1, decay=0.9, eta_min=1e-3, anderson=3)
    f, z0, _ = contraction(dtype)
    with count_host_reads() as reads:
        z, st = solve(f, z0, cfg, training=True)
    assert reads.total == 1
    force_eager(monkeypatch)
    z_ref, ref = solve(f, z0, cfg, training=True)
    assert torch.equal(z, z_ref) and torch.equal(st.final_eta, ref.final_eta)
    assert torch.equal(st.sample_residual, ref.sample_residual) and st.iterations == ref.iterations == 12


def test_unroll_gradient_is_the_eager_loop_s():
    f, z0, _ = contraction(torch.float64)
    grads = []
    for cfg in (SolverConfig(max_iter=9, tol=0.0, backward="unroll"),
                SolverConfig(max_iter=9, tol=1e-15, eta_min=0.0, backward="unroll")):   # eager loop
        w = torch.ones(1, dtype=torch.float64, requires_grad=True)
        z, st = solve(lambda z: f(z) * w, z0, cfg, training=True)
        assert st.iterations == 9
        (g,) = torch.autograd.grad(z.sum(), w)
        grads.append(g)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("cfg", [dict(tol=0.0), dict(tol=1e-6, check_every=3),
                                 dict(tol=1e-6, check_every=3, freeze_converged=True)])
def test_nonfinite_between_reads_keeps_the_last_finite_iterate(cfg):
    """As the eager solve: stop, report the iteration that went non-finite, keep z_3."""
    calls = []

    def f(z):
        calls.append(1)
        return z * 0.5 + 1 if len(calls) < 4 else z * float("inf")

    z, stats = solve(f, torch.zeros(2, 3, 1), SolverConfig(max_iter=50, **cfg), training=False)
    assert stats.stopped_by == "nonfinite" and stats.iterations == 4
    assert torch.allclose(z, torch.full_like(z, 1.75))       # z_3 = 0 -> 1 -> 1.5 -> 1.75
    assert torch.isfinite(stats.sample_residual).all() and float(stats.final_eta.min()) == 1.0


@pytest.mark.parametrize("cfg", [dict(tol=0.0, max_iter=7), dict(tol=1e-3, check_every=3)])
def test_consensus_runs_every_iteration_whatever_the_read_schedule(cfg):
    """Under TP the flags are agreed every iteration (the collective stays in step on every rank);
    a peer still unconverged keeps this rank going to the same read iteration."""
    c = torch.tensor([0.1], dtype=torch.float64)
    seen = []

    def consensus(flags):
        seen.append(flags.clone())
        peer = StopFlags(nonfinite=torch.tensor(False), unconverged=torch.tensor([len(seen) < 7]),
                         no_progress=torch.tensor([False]))
        return torch.maximum(flags, peer.pack())

    _, stats = solve(lambda z: c * z + (1 - c), torch.zeros(1, 1, 1, dtype=torch.float64),
                     SolverConfig(**cfg), training=False, consensus=consensus)
    assert len(seen) == stats.iterations == (7 if cfg["tol"] == 0 else 9)


@pytest.mark.parametrize("value", [0, -2])
def test_check_every_is_validated(value):
    with pytest.raises(ConfigError) as info:
        from_dict(SolverConfig, {"check_every": value}, "solver")
    assert "solver.execution.check_every': must be >= 1" in str(info.value)


# ---------------------------------------------------------------------- statistics: one read
def old_to_dict(s) -> dict:
    """SolverStats.to_dict as it was before (one read per number)."""
    r = s.sample_residual.float()
    finite = r[torch.isfinite(r)]
    q = torch.quantile(finite, torch.tensor([0.5, 0.9], dtype=finite.dtype)).tolist() if finite.numel() else [
        float("nan")] * 2
    out = {"iterations": s.iterations, "max_iter": s.max_iter, "stopped_by": s.stopped_by,
           "residual_p50": q[0], "residual_p90": q[1], "residual_max": float(r.max()),
           "converged_fraction": float((r < s.tol).float().mean()),
           "token_converged_fraction": float(s.token_converged.float().mean()),
           "eta": float(s.final_eta.float().mean()), "eta_lowest": float(s.final_eta.min()),
           "nonfinite": s.nonfinite}
    if s.backward_iterations is not None:
        out["backward_iterations"] = s.backward_iterations
        out["backward_residual"] = float(s.backward_residual)
    return out


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_log_step_reads_every_layer_s_statistics_at_once(autocast):
    model = tiny_model("mixed", solver=LIVE)
    model.train()
    window: dict = {}
    for x in token_batches(32, n=2, batch=4, seq=24):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        collect_layer_stats(model, window)
    assert len(window) == 3 and all(len(rows) == 2 for rows in window.values())
    with count_host_reads() as reads:
        dicts = as_dicts(window)
    assert reads.total == 1
    for name, rows in window.items():
        for s, d in zip(rows, dicts[name]):
            assert isinstance(s.backward_residual, (torch.Tensor, type(None)))
            assert d == pytest.approx(old_to_dict(s), nan_ok=True)
            assert d == s.to_dict()


def test_statistics_with_a_nonfinite_sample_read_once():
    f = lambda z: torch.where(torch.arange(3).view(3, 1, 1) == 1, z * float("nan"), 0.5 * z + 1)  # noqa: E731
    _, st = solve(f, torch.ones(3, 2, 2), SolverConfig(max_iter=5, tol=0.0), training=False)
    st.sample_residual = torch.tensor([0.1, float("nan"), 0.3])
    with count_host_reads() as reads:
        (d,) = to_dicts([st])
    assert reads.total == 1
    assert d == pytest.approx(old_to_dict(st), nan_ok=True)


def test_aten_op_counter_sees_one_iteration():
    with count_aten_ops() as ops:
        torch.ones(2) + 1
    assert ops.total >= 2 and "aten.add" in ops.by_op


class _Samples:
    """A validation dataset of fixed token rows (``num_samples``, ``batch(indices)``)."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.num_samples = rows, rows.shape[0]

    def batch(self, index):
        return self.rows[torch.as_tensor(index)]


def test_a_validation_reads_twice_whatever_its_number_of_batches():
    """Beside its solves' own reads (the eager stop, one per iteration), the loss sums once and every
    layer's statistics of every batch once (they stay on the device until then)."""
    from fpscale.parallel.state import ParallelState
    from fpscale.train.validation import validate
    model = tiny_model("mixed", solver=LIVE)
    data = _Samples(token_batches(32, n=1, batch=12, seq=25)[0])
    with count_host_reads() as reads:
        out = validate(model, model, data, 3, 4, ParallelState())
    assert len(out["layers"]) == 3 and all(s["iters_mean"] >= 1 for s in out["layers"].values())
    in_solves = round(sum(s["iters_mean"] * 4 for s in out["layers"].values()))     # 4 batches
    assert reads.total == in_solves + 2, (reads.by_method, in_solves)
