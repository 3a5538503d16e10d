"""``solver.chunk`` agrees with the other ranks once per chunk (fpscale.solvers.chunk_agree): under
``agree: dp`` one SUM of the chunk's [K, 3] counts and a replay to the first stopping iteration, under
TP one MAX of the packed flags that checks the ranks saw the same. In one process: a DP "group" of two
identical ranks (the counts doubled) must stop as one process running the batch twice and as the
eager loop with the same agreement; the collectives and host reads are one each per chunk. The
multi-process runs: tests/parallel/run_tp_model.py (TP2) and run_dp_agree.py (DP2), chunk variants."""
import math

import pytest
import torch

import fpscale.solvers.chunked as chunked
from fpscale.profiling import count_host_reads
from fpscale.solvers import SolverConfig
from fpscale.solvers.iterate import iterate
from tests.solvers.test_chunked import contraction


@pytest.fixture(autouse=True)
def eager_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "COMPILE", False)


class Twice:
    """A DP group of ``size`` ranks holding the same samples: the SUM of the counts is size x them."""

    def __init__(self, size=2):
        self.size, self.calls = size, 0

    def __call__(self, counts):
        self.calls += 1
        return counts * self.size


class Same:
    """A TP group whose ranks saw the same flags (MAX = the flags); ``skew`` makes one rank differ."""

    def __init__(self, skew=False):
        self.calls, self.skew = 0, skew

    def __call__(self, flags):
        self.calls += 1
        out = flags.clone()
        if self.skew:
            out[0] += 1
        return out


CASES = {
    "quantile": dict(tol=1e-6, stop_quantile=0.25),
    "half": dict(tol=1e-3, stop_quantile=0.5),
    "patience": dict(tol=1e-9, patience=2, decay=0.5, eta_min=0.05, max_iter=60),
    "freeze_sample": dict(decisions="sample", tol=1e-4, freeze_converged=True, stop_quantile=0.0),
    "cap": dict(tol=0.0, max_iter=7),
}


@pytest.mark.parametrize("K", [3, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_dp_agreement_once_per_chunk_equals_the_eager_agreement(case, K):
    f, z0 = contraction()
    cfg = SolverConfig(**CASES[case])
    twice = Twice()
    a = iterate(f, z0, cfg, quantile=cfg.stop_quantile, agree=twice)
    eager_calls, twice.calls = twice.calls, 0
    with count_host_reads() as reads:
        b = chunked.run_loop(f, z0, SolverConfig(**CASES[case], chunk=K), quantile=cfg.stop_quantile, agree=twice)
    assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by)
    assert torch.equal(b.z, a.z) and torch.equal(b.eta, a.eta) and torch.equal(b.token_res, a.token_res)
    assert torch.equal(b.carry.frozen, a.carry.frozen) and torch.equal(b.carry.patience_left, a.carry.patience_left)
    chunks = math.ceil(a.iterations / K)
    assert eager_calls == a.iterations and twice.calls == chunks and reads.total == chunks, reads.by_method
    # one process over the batch twice: the same stop (the quantile over 2B samples)
    f2, z2 = contraction(B=12, scale=torch.linspace(0.3, 1.1, 6, dtype=torch.float64).repeat(2)[:, None, None])
    one = iterate(lambda z: torch.cat([f(z[:6]), f(z[6:])]), torch.cat([z0, z0]), cfg, quantile=cfg.stop_quantile)
    assert (one.iterations, one.stopped_by) == (b.iterations, b.stopped_by) and torch.equal(one.z[:6], b.z)


def test_dp_nonfinite_stop_replays_to_the_eager_state():
    """A residual that goes non-finite at iteration 5 (z4 = 1.875 > 1.8) in the second chunk of 3: the
    chunk is replayed from its start to iteration 5 without the update there, as the eager loop breaks."""
    calls = {"n": 0}

    def f(z):
        calls["n"] += 1
        out = 0.5 * z + 1
        return torch.where(z > 1.8, float("nan"), out)
    z0 = torch.zeros(2, 3, 2, dtype=torch.float64)
    cfg = SolverConfig(tol=1e-12, max_iter=20, patience=1)
    a = iterate(f, z0, cfg, quantile=0.0, agree=Twice())
    calls["n"] = 0
    b = chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 3}), quantile=0.0, agree=Twice())
    assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by) == (5, "nonfinite")
    assert torch.equal(b.z, a.z) and torch.isfinite(b.z).all() and torch.equal(b.token_res, a.token_res)
    assert torch.equal(b.carry.best, a.carry.best) and torch.equal(b.carry.patience_left, a.carry.patience_left)
    assert calls["n"] == 6 + 3          # two chunks of 3, then the second again (the replay runs a whole chunk)


@pytest.mark.parametrize("decisions", ["token", "sample"])
def test_tp_flags_are_checked_once_per_chunk(decisions):
    f, z0 = contraction()
    cfg = SolverConfig(tol=1e-6, stop_quantile=0.25, decisions=decisions, freeze_converged=True, patience=2,
                       decay=0.7)
    same = Same()
    a = iterate(f, z0, cfg, quantile=0.25, consensus=same)
    same.calls = 0
    with count_host_reads() as reads:
        b = chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 4}), quantile=0.25, consensus=same)
    assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by) and torch.equal(b.z, a.z)
    assert same.calls == reads.total == math.ceil(a.iterations / 4)
    with pytest.raises(RuntimeError, match="solver.chunk = 4 under tensor parallelism.*solver.chunk: 0"):
        chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 4}), quantile=0.25, consensus=Same(skew=True))


def test_flags_of_more_than_31_iterations_span_words():
    """A chunk of 40 iterations packs its flags into two words per unit; a rank differing only in the
    second word is still caught."""
    from fpscale.solvers.chunk_agree import BITS, differs, pack_flags
    from fpscale.solvers.stop_rule import StopFlags
    words, nonfinite = [torch.zeros(3, dtype=torch.long)] * 2, [torch.zeros((), dtype=torch.long)] * 2
    on = torch.ones((), dtype=torch.bool)
    for i in range(40):
        flags = StopFlags(nonfinite=torch.tensor(i == 35), unconverged=torch.tensor([True, i < 33, False]),
                          no_progress=torch.tensor([i % 2 == 0, False, True]))
        pack_flags(words, nonfinite, flags, i, on)
    packed = torch.cat([torch.stack(nonfinite), torch.stack(words).flatten()])
    assert packed[1].item() == 1 << (35 - BITS) and (packed >= 0).all()
    assert not differs(lambda t: t, packed)
    other = packed.clone()
    other[-2] ^= 1 << 3          # unit 1, second word: another rank's flag at iteration 32
    assert differs(lambda t: torch.maximum(t, torch.cat([other, -other])), packed)


@pytest.mark.slow
@pytest.mark.parametrize("group", ["dp", "tp"])
def test_agreed_chunks_compile_as_one_graph(group, monkeypatch):
    """With the agreement outside the chunk, a DP or TP solve's chunk traces whole: no graph break, one
    graph for the first pass, the replay and every iteration count (dynamo's counters, aot_eager)."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(chunked, "COMPILE", True)
    monkeypatch.setattr(chunked, "BACKEND", "aot_eager")
    f, z0 = contraction()
    cfg = SolverConfig(tol=1e-3, stop_quantile=0.25, patience=2, decay=0.7)
    kw = {"agree": Twice()} if group == "dp" else {"consensus": Same()}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for cap in (5, 9, 40):
            a = iterate(f, z0, cfg, quantile=0.25, max_iter=cap, **kw)
            b = chunked.run_loop(f, z0, SolverConfig(**{**vars(cfg), "chunk": 4}), quantile=0.25, max_iter=cap, **kw)
            assert (b.iterations, b.stopped_by) == (a.iterations, a.stopped_by)
            torch.testing.assert_close(b.z, a.z, rtol=1e-12, atol=1e-14)
    assert a.stopped_by == "quantile" and a.iterations % 4 != 0          # the DP solve replayed its last chunk
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])


# ------------------------------------------------------------------------------ solver.cuda_graph
def test_cuda_graph_settings_name_the_key_and_the_constraint():
    from fpscale.errors import ConfigError
    from fpscale.solvers import solve
    with pytest.raises(ConfigError, match=r"cuda_graph.*solver.execution.chunk > 0"):
        SolverConfig(cuda_graph=True).validate()
    with pytest.raises(ConfigError, match=r"cuda_graph.*unroll"):
        SolverConfig(cuda_graph=True, chunk=4, backward="unroll").validate()
    SolverConfig(cuda_graph=True, chunk=4).validate()
    f, z0 = contraction()
    with pytest.raises(ValueError, match=r"solver.cuda_graph = true captures CUDA graphs: it needs a CUDA device"):
        with torch.no_grad():
            solve(f, z0, SolverConfig(cuda_graph=True, chunk=4))
    with pytest.raises(ValueError, match=r"solver.cuda_graph = true \(layers.0.*\) with parallel.tp = 2"):
        from tests.models.helpers import tiny_model
        chunked.check_cuda_graphs(tiny_model("fpsa", solver={"chunk": 4, "cuda_graph": True}), "cuda", 2)
    with pytest.raises(ValueError, match=r"solver.cuda_graph = true \(layers.0.*\) captures CUDA graphs.*on cpu"):
        chunked.check_cuda_graphs(tiny_model("fpsa", solver={"chunk": 4, "cuda_graph": True}), "cpu", 1)
    chunked.check_cuda_graphs(tiny_model("fpsa", solver={"chunk": 4}), "cpu", 2)       # off: nothing to check


def test_trainer_refuses_cuda_graph_on_cpu_at_launch(tmp_path):
    import fpscale
    from fpscale.train.trainer import Trainer
    cfg = fpscale.load_config("configs/tiny_mixed.yaml", ["solver.chunk=4", "solver.cuda_graph=true",
                                                          "data.source=synthetic", f"train.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"solver.cuda_graph = true \(layers.*CUDA device"):
        Trainer(cfg)


@pytest.mark.slow
def test_func_vjp_adjoint_equals_the_recorded_adjoint(monkeypatch):
    """The adjoint step of ``solver.adjoint_step: vjp`` (torch.func.vjp of f at z*) gives the recorded
    adjoint's training step exactly (fpsa, float64, eager chunks; compiled: bench/adjoint_vjp.py)."""
    import tests.solvers.test_chunked as test_chunked
    from tests.solvers.test_chunked import step_of
    la, ga, sa, _ = step_of("fpsa", "implicit", 4)
    monkeypatch.setitem(test_chunked.SOLVER, "adjoint_step", "vjp")
    lb, gb, sb, _ = step_of("fpsa", "implicit", 4)
    assert (sb.iterations, sb.backward_iterations) == (sa.iterations, sa.backward_iterations)
    assert torch.equal(lb, la) and all(torch.equal(a, b) for a, b in zip(ga, gb))
