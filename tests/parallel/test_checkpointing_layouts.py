"""``model.checkpoint=block`` on the parallel layouts, with dropout (tiny_mixed: attn, fpsa, fpmamba,
looped): one process = TP2 = DP2 ZeRO-3.

Recomputation changes no number: on a layout, block trains exactly as none with the same
dropout (residual masks from the default stream, attention masks per TP shard from the tracker's
stream, which the recomputation must draw again); TP2 with residual dropout trains as one process.
Under ZeRO-3 (d_model 384: the attention and MLP weights lie above the persistence threshold, so
they are partitioned) the recomputation re-enters the modules: their hooks gather the weights
again in backward, so the run all-gathers more often than without checkpointing.
Every run solves to a fixed depth (``PIN``, tests/parallel/launch.py): TP2 against one process sums in another
order, where a tolerance stop could flip an iteration.
"""
import pytest

from tests.parallel.launch import PIN, assert_pinned, layout_cases, one_process_reference

pytestmark = pytest.mark.multiprocess
DROPOUT = ["model.dropout=0.2", "model.attn_dropout=0.2", PIN]
LAYOUTS = {"tp2": ["parallel.tp=2", "zero_stage=1"], "dp2-zero3": ["zero_stage=3", "model.d_model=384"]}
RESIDUAL = ["model.dropout=0.2", "train.steps=3", PIN]
# every two-rank run of this file, each as in a launch of its own (400 s each), in ONE launch
CASES = {**{f"{name}-{mode}": [*layout, *DROPOUT, "train.steps=3", *(["model.checkpoint=block"] if mode == "block"
                                                                      else [])]
            for name, layout in LAYOUTS.items() for mode in ("none", "block")},
         "tp2-block-residual": ["parallel.tp=2", "zero_stage=1", "model.checkpoint=block", *RESIDUAL]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """run_layout.py's CASES on 2 ranks, one after the other in one launch: each case's ranks."""
    ranks = layout_cases(2, tmp_path_factory.mktemp("ckpt"), CASES, timeout_each=400)
    assert all(len(r) == 2 for r in ranks.values())
    return ranks


WAITS = pytest.mark.timeout(400 * len(CASES) + 60)      # the first test to ask for ``two_ranks`` waits for it


def losses(run):
    """Every step's loss and gradient norm, in one flat list."""
    return [x for s in run["steps"] for x in (s["loss"], s["grad_norm"])]


@WAITS
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_checkpointing_trains_as_none_on_a_layout(two_ranks, layout):
    none, block = two_ranks[f"{layout}-none"], two_ranks[f"{layout}-block"]
    for got, want in zip(block, none):
        assert losses(got) == pytest.approx(losses(want), rel=1e-6)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
        assert got["replicated"] == pytest.approx(want["replicated"], rel=1e-6)
    if "zero_stage=3" in LAYOUTS[layout]:      # the recomputed modules gathered their weights again
        gathers = [sum(n for k, n in r["checked_collectives"].items() if k.startswith("all_gather"))
                   for r in (block[0], none[0])]
        assert gathers[0] > gathers[1] > 0, gathers


@WAITS
def test_block_checkpointing_under_tp2_trains_as_one_process(tmp_path, two_ranks):
    """Residual dropout only (its masks are one process's on every TP shard): TP2 with block
    checkpointing gives one process's losses (fpscale's TP tolerance)."""
    (tmp_path / "one").mkdir()
    one = one_process_reference(str(tmp_path / "one"), *RESIDUAL)
    assert_pinned(one)
    for r in two_ranks["tp2-block-residual"]:
        for got, want in zip(r["steps"], one["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
