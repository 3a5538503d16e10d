"""Tensor parallelism of every layer type against the whole model and against one process.

tiny_mixed's comparisons with one process solve to a fixed depth (``PIN``, tests/parallel/launch.py: tol 0,
6 iterations): a tolerance stop could flip an iteration under the shards' other summation order. The
registered layer (``damped``) keeps its tolerance stop, the one fp32 layout test that does: it compares the
iteration counts first and the values of the steps up to the first that differs (float64 ones:
run_tp_model.py, test_dp_agree.py)."""
from types import SimpleNamespace

import pytest

import fpscale
from fpscale.parallel.parallelize import parallelize
from fpscale.parallel.state import ParallelState
from tests.parallel.launch import (
    PIN,
    assert_deep_supervision_matches,
    assert_pinned,
    layout_cases,
    read_ranks,
    torchrun,
)

SCRIPT = "tests/parallel/run_layout.py"
DAMPED = ["plugin=tests.layers.damped_mlp", "config=tiny_attn.yaml",
          "model.layers=[{type: attn}, {type: damped_mlp, scale: 0.6, solver: {max_iter: 12, tol: 1e-4}}, "
          "{type: attn}]"]
RESIDUAL = ["model.dropout=0.2", PIN]
# every two-rank case of this file, each as in a launch of its own (400 s or 300 s), in ONE launch
TP2 = {"tp2-zero0": (["parallel.tp=2", "zero_stage=0", PIN], 400),
       "tp2-zero1": (["parallel.tp=2", "zero_stage=1", PIN], 400),
       "tp2-zero3": (["parallel.tp=2", "zero_stage=3", "ds=1", PIN], 400),
       "damped": (["parallel.tp=2", "zero_stage=1", *DAMPED], 300),
       "dropout": (["parallel.tp=2", "zero_stage=1", *RESIDUAL], 300),
       "dropout-attn": (["parallel.tp=2", "zero_stage=1", *RESIDUAL, "model.attn_dropout=0.2"], 300)}
# and the one-process references these need besides the session's ``reference``, in one process
ONE = {"damped": DAMPED, "dropout": RESIDUAL}
WAITS = pytest.mark.timeout(sum(t for _, t in TP2.values()) + 300 * len(ONE) + 60)   # the first test waits


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """run_layout.py's TP2 cases on 2 ranks, one after the other in one launch: each case's ranks."""
    longest = max(t for _, t in TP2.values())
    return layout_cases(2, tmp_path_factory.mktemp("tp2"), {k: args for k, (args, _) in TP2.items()}, longest)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, dict]:
    return {k: ranks[0] for k, ranks in layout_cases(1, tmp_path_factory.mktemp("one"), ONE).items()}


@pytest.mark.multiprocess
def test_every_layer_type_split_over_tp_equals_the_whole_model(tmp_path):
    """float64: loss, every merged gradient, power-iteration vectors and iteration counts (forward
    and adjoint) of attn, fpsa, fpmamba (Householder, DPLR, Kronecker) and looped layers."""
    torchrun(2, "tests/parallel/run_tp_model.py", [str(tmp_path)], timeout=300)
    assert (tmp_path / "ok").exists()


@pytest.mark.multiprocess
@WAITS
@pytest.mark.parametrize("nproc,zero", [(2, 0), (2, 1), (2, 3), (4, 2)],
                         ids=["tp2-zero0", "tp2-zero1", "tp2-zero3", "tp2xdp2-zero2"])
def test_tp_layouts_match_one_process(tmp_path, request, reference, nproc, zero):
    """tiny_mixed (attn, fpsa, fpmamba, looped) trained 5 steps on a TP layout vs one process; TP2
    ZeRO-3 also trains a looped core with deep supervision (``ds=1``) in the same processes."""
    ds = ["ds=1"] if (nproc, zero) == (2, 3) else []
    if nproc == 2:          # the module's two-rank launch
        ranks = request.getfixturevalue("two_ranks")[f"tp2-zero{zero}"]
    else:
        torchrun(nproc, SCRIPT, [str(tmp_path), "parallel.tp=2", f"zero_stage={zero}", PIN, *ds], timeout=400)
        ranks = read_ranks(str(tmp_path))
    assert len(ranks) == nproc
    for r in [reference, *ranks]:
        assert_pinned(r)
    if ds:
        assert_deep_supervision_matches(ranks, reference)
    for r in ranks:
        # fp32; sharded matmuls and reductions sum in another order than one process
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # the two ranks of a TP group iterate together (consensus), step by step and layer by layer
    for a, b in zip(ranks[0::2], ranks[1::2]):
        assert [s["iterations"] for s in a["steps"]] == [s["iterations"] for s in b["steps"]]


def solves(step: dict) -> tuple:
    """A run_layout.py step's iteration counts: forward and adjoint, every layer."""
    return step["iterations"], step["backward_iterations"]


@pytest.mark.multiprocess
@WAITS
def test_a_layer_type_added_by_registration_alone_trains_under_tp2(two_ranks, one_process):
    """tests/layers/damped_mlp.py registers a looped type fpscale has never heard of; between two
    attn layers it trains 5 steps split over TP 2 as on one process (its MLP splits by the plan
    the MLP declares, its solver agrees over the shards), iteration counts included.
    Its tolerance stop (1e-4) stays: the iteration counts are compared first, then the values of the steps up to
    the first whose counts (forward or adjoint) differ, where a solve near its threshold flipped under the shards'
    other summation order (both shards of a step always agree: the stop is all-reduced); the first step, from
    the same weights, must agree."""
    reference, ranks = one_process["damped"], two_ranks["damped"]
    counts = [s["iterations"]["layers.1.damped_mlp"] for s in reference["steps"]]
    assert all(1 < its[0] < 12 for its in counts)        # it iterates, and converges before the cap
    assert all(its[0] > 1 for s in reference["steps"] for its in [s["backward_iterations"]["layers.1.damped_mlp"]])
    assert solves(ranks[0]["steps"][0]) == solves(reference["steps"][0])
    for r in ranks:
        assert [solves(s) for s in r["steps"]] == [solves(s) for s in ranks[0]["steps"]]
        for got, want in zip(r["steps"], reference["steps"]):
            if solves(got) != solves(want):
                break
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_bad_tp_sizes_name_the_numbers():
    state = ParallelState(tp_size=3)
    with pytest.raises(ValueError, match=r"model.n_heads = 4 is not divisible by parallel.tp = 3"):
        parallelize(fpscale.build_model(fpscale.load_config(None, ["model.layers.0.type=attn"])), state)
    state.tp_size = 2
    with pytest.raises(ValueError, match=r"model.vocab_size = 8001 is not divisible by parallel.tp = 2"):
        parallelize(fpscale.build_model(fpscale.load_config(None, ["model.vocab_size=8001"])), state)
    state.tp_size = 8      # d_inner = 2 x 66 = 132 channels; an fpmamba-only model has no heads to check
    with pytest.raises(ValueError, match=r"d_inner \(expand 2 x d_model 66\) = 132 is not divisible by "
                                         r"parallel.tp = 8 \(model.layers.0, fpmamba, splits it\)"):
        parallelize(fpscale.build_model(fpscale.load_config(
            None, ["model.layers.0.type=fpmamba", "model.d_model=66", "model.n_heads=3", "model.vocab_size=8000"])),
            state)


def test_decoding_a_tp_shard_is_refused():
    import torch
    state = ParallelState(tp_size=2)
    model = parallelize(fpscale.build_model(fpscale.load_config(None, ["model.vocab_size=32"])), state)
    with pytest.raises(ValueError, match="split over tensor-parallel ranks"):
        fpscale.generate(model, torch.zeros(1, 3, dtype=torch.long), 2)


def test_world_size_not_divisible_by_tp(monkeypatch):
    from fpscale.parallel.state import init_parallel
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by parallel.tp = 2"):
        init_parallel(2)


@pytest.mark.multiprocess
@WAITS
def test_dropout_under_tp_acts_and_matches_one_process(two_ranks, one_process, reference):
    """Residual dropout draws from the default stream, the same on both shards and on one process:
    TP2 with ``model.dropout`` gives the losses of one process with the same dropout, and they differ
    from the run without dropout (so dropout acts). Attention dropout draws a mask per shard from
    the TP stream: adding it changes the losses again, and replicated weights stay equal across shards."""
    def losses(ranks):
        return [s["loss"] for s in ranks[0]["steps"]]

    one, tp, tp_attn = one_process["dropout"], two_ranks["dropout"], two_ranks["dropout-attn"]

    def differ(a, b):      # every step further apart than the TP-vs-one-process tolerance
        return all(abs(x - y) > 1e-5 * abs(y) for x, y in zip(a, b))

    assert losses(tp) == pytest.approx(losses([one]), rel=1e-5)        # the one-process masks
    assert differ(losses(tp), losses([reference]))                       # residual dropout acts
    assert differ(losses(tp_attn), losses(tp))                           # so does attention dropout
    for run in (tp, tp_attn):
        r0, r1 = run
        assert r0["replicated"] and r0["replicated"] == r1["replicated"]


def test_rng_tracker_streams():
    import torch

    from fpscale.parallel.random import RNGTracker, load_rng_state, rng_state, seed_default_stream
    shards = [SimpleNamespace(tp_rank=r, dp_rank=0, device=torch.device("cpu")) for r in (0, 1)]
    draws = []
    for s in shards:
        seed_default_stream(7, s)
        tracker = RNGTracker.for_tp(7, s)
        with tracker.fork():
            in_region = torch.rand(4)
        draws.append((in_region, torch.rand(4)))
    assert not torch.equal(draws[0][0], draws[1][0])      # a different mask per shard in the region
    assert torch.equal(draws[0][1], draws[1][1])          # the same replicated stream outside it
    seed_default_stream(7, shards[0])
    assert torch.equal(torch.rand(4), draws[0][1])        # the fork left the default stream alone
    saved = rng_state(tracker, torch.device("cpu"))
    with tracker.fork():
        a = torch.rand(3)
    b = torch.rand(3)
    load_rng_state(saved, tracker, torch.device("cpu"))
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)
    assert torch.equal(torch.rand(3), b)
