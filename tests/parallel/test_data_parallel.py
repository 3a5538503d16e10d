"""Data parallelism through DeepSpeed ZeRO 0/1/2/3 against one process (tiny_mixed: every layer type).

The comparisons with one process solve to a fixed depth (``PIN``, tests/parallel/launch.py: tol 0, 6
iterations), so no tolerance stop can flip an iteration under the all-reduce's other summation order; the
uneven-convergence and ``agree: dp`` cases keep their tolerances (their point), and compare no values."""

import pytest

from tests.parallel.launch import (
    PIN,
    assert_deep_supervision_matches,
    assert_pinned,
    layout_cases,
    one_process_reference,
    read_ranks,
    torchrun,
)

pytestmark = pytest.mark.multiprocess
SCRIPT = "tests/parallel/run_layout.py"
NAN_LAYOUTS = ["zero_stage=0", "zero_stage=1", "zero_stage=3", "parallel.tp=2"]
# every two-rank case of this file, each run as in a launch of its own (300 s each), in ONE launch
CASES = {**{f"dp2-zero{z}": [f"zero_stage={z}", PIN, *(["ds=1"] if z == 3 else [])] for z in range(4)},
         "uneven-zero3": ["zero_stage=3", "rank_tol=5e-1,1e-7", "solver.forward.max_iter=60"],
         "agree-zero1": ["zero_stage=1", "rank_tol=5e-1,1e-7", "solver.forward.max_iter=12", "solver.forward.agree=dp"],
         **{f"nan-{layout}": ["nan_at=2", PIN, *([layout] if "zero" in layout else [layout, "zero_stage=1"])]
            for layout in NAN_LAYOUTS}}
WAITS = pytest.mark.timeout(300 * len(CASES) + 60)      # the first test to ask for ``two_ranks`` waits for it


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """run_layout.py's CASES on 2 ranks, one after the other in one launch: each case's ranks."""
    return layout_cases(2, tmp_path_factory.mktemp("dp2"), CASES)


@WAITS
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_dp2_matches_one_process(two_ranks, reference, zero_stage):
    """ZeRO-3 also trains a looped core with deep supervision (``ds=1``, solver.agree: dp) in the same
    processes: DP2 with micro-batch 4 = one process with the 8."""
    ranks = two_ranks[f"dp2-zero{zero_stage}"]
    if zero_stage == 3:
        assert_deep_supervision_matches(ranks, reference)
    assert len(ranks) == 2 and ranks[0]["world"] == 2
    for r in [reference, *ranks]:
        assert_pinned(r)
    for r in ranks:
        # fp32; the gradient all-reduce sums in another order than one process: 1e-5 relative
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # each rank solved its own half of every global batch: together, the reference's micro-batches
    for step, ref in zip(zip(ranks[0]["steps"], ranks[1]["steps"]), reference["steps"]):
        for layer, counts in ref["iterations"].items():
            assert step[0]["iterations"][layer] + step[1]["iterations"][layer] == counts


@WAITS
def test_zero3_with_uneven_convergence_across_ranks_finishes(two_ranks):
    """DP ranks take different numbers of solver iterations (own tolerances); ZeRO-3 must not hang."""
    r0, r1 = two_ranks["uneven-zero3"]
    differ = [layer for layer in r0["steps"][0]["iterations"]
              if r0["steps"][0]["iterations"][layer] != r1["steps"][0]["iterations"][layer]]
    assert {"layers.1.fpsa", "layers.2.fpmamba"} <= set(differ), (r0["steps"][0], r1["steps"][0])
    assert all(s["grad_norm"] == s["grad_norm"] for s in r0["steps"])     # finite, not NaN


@WAITS
def test_agree_dp_makes_ranks_with_uneven_tolerances_run_the_same_iterations(two_ranks):
    """solver.agree: dp through the trainer (ZeRO-1): the ranks' own tolerances differ, yet every
    solve stops when the DP group's decision says so, on both ranks at the same iteration."""
    r0, r1 = two_ranks["agree-zero1"]
    assert [s["iterations"] for s in r0["steps"]] == [s["iterations"] for s in r1["steps"]]
    assert all(s["grad_norm"] == s["grad_norm"] for s in r0["steps"])


@pytest.fixture(scope="module")
def reference_nan(tmp_path_factory):
    return one_process_reference(str(tmp_path_factory.mktemp("ref_nan")), "nan_at=2", PIN)


@WAITS
@pytest.mark.parametrize("layout", NAN_LAYOUTS)
def test_one_rank_nan_skips_the_step_on_every_rank(two_ranks, reference_nan, layout):
    """The last rank's loss is NaN in step 2: every rank skips that update (the global gradient norm
    is not finite everywhere) and goes on exactly as one process that skipped the same step."""
    assert [s["skipped"] for s in reference_nan["steps"]] == [False, False, True, False, False]
    for r in two_ranks[f"nan-{layout}"]:
        assert [s["skipped"] for s in r["steps"]] == [False, False, True, False, False]
        for i, (got, want) in enumerate(zip(r["steps"], reference_nan["steps"])):
            if i != 2:
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert r["val_loss"] == pytest.approx(reference_nan["val_loss"], rel=1e-5)


def test_zero3_validation_with_fewer_batches_than_ranks_finishes(tmp_path):
    """eval_batches 1 on 4 ranks under ZeRO-3: three ranks have no batch of their own, yet every
    forward all-gathers parameters with all four. d_model 384 puts the attention and MLP weights
    (>= 442k elements) above ZeRO-3's persistence threshold (1e5), so they are partitioned and
    gathered: before validation dealt a turn to every rank this waited out the collective timeout.
    The loss is the one batch's, as on one process."""
    args = ["config=tiny_attn.yaml", "model.d_model=384", "train.eval_batches=1", "train.steps=1",
            "parallel.timeout_s=60"]
    (tmp_path / "dp4").mkdir()
    (tmp_path / "one").mkdir()
    torchrun(4, SCRIPT, [str(tmp_path / "dp4"), "zero_stage=3", *args], timeout=240)
    ranks = read_ranks(str(tmp_path / "dp4"))
    assert len(ranks) == 4 and ranks[0]["checked_collectives"]["all_gather_into_tensor"] > 0
    reference = one_process_reference(str(tmp_path / "one"), *args)
    assert all(r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5) for r in ranks)
