"""``model.checkpoint=block`` on the parallel layouts, with dropout (tiny_mixed: attn, fpsa, fpmamba,
looped): one process = TP2 = DP2 ZeRO-3.

Recomputation changes no number: on a layout, block trains exactly as none with the same
dropout (residual masks from the default stream, attention masks per TP shard from the tracker's
stream, which the recomputation must draw again); TP2 with residual dropout trains as one process.
Under ZeRO-3 (d_model 384: the attention and MLP weights lie above the persistence threshold, so
they are partitioned) the recomputation re-enters the modules: their hooks gather the weights
again in backward, so the run all-gathers more often than without checkpointing.
"""
import pytest

from tests.parallel.launch import one_process_reference, read_ranks, torchrun

pytestmark = pytest.mark.multiprocess
SCRIPT = "tests/parallel/run_layout.py"
DROPOUT = ["model.dropout=0.2", "model.attn_dropout=0.2"]


def losses(run):
    """Every step's loss and gradient norm, in one flat list."""
    return [x for s in run["steps"] for x in (s["loss"], s["grad_norm"])]


def train(path, nproc, *args):
    path.mkdir()
    torchrun(nproc, SCRIPT, [str(path), *args], timeout=400)
    ranks = read_ranks(str(path))
    assert len(ranks) == nproc
    return ranks


@pytest.mark.parametrize("layout", [["parallel.tp=2", "zero_stage=1"], ["zero_stage=3", "model.d_model=384"]],
                         ids=["tp2", "dp2-zero3"])
def test_block_checkpointing_trains_as_none_on_a_layout(tmp_path, layout):
    args = [*layout, *DROPOUT, "train.steps=3"]
    none = train(tmp_path / "none", 2, *args)
    block = train(tmp_path / "block", 2, *args, "model.checkpoint=block")
    for got, want in zip(block, none):
        assert losses(got) == pytest.approx(losses(want), rel=1e-6)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
        assert got["replicated"] == pytest.approx(want["replicated"], rel=1e-6)
    if "zero_stage=3" in layout:      # the recomputed modules gathered their weights again
        gathers = [sum(n for k, n in r["checked_collectives"].items() if k.startswith("all_gather"))
                   for r in (block[0], none[0])]
        assert gathers[0] > gathers[1] > 0, gathers


def test_block_checkpointing_under_tp2_trains_as_one_process(tmp_path):
    """Residual dropout only (its masks are one process's on every TP shard): TP2 with block
    checkpointing gives one process's losses (fpscale's TP tolerance)."""
    args = ["model.dropout=0.2", "train.steps=3"]
    (tmp_path / "one").mkdir()
    one = one_process_reference(str(tmp_path / "one"), *args)
    for r in train(tmp_path / "tp2", 2, "parallel.tp=2", "zero_stage=1", "model.checkpoint=block", *args):
        for got, want in zip(r["steps"], one["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
