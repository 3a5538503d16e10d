"""The epsilon layer type (tiny_epsilon: attn, epsilon with HQSA, attn) on TP 2 and on DP 2 under
ZeRO-3 against one process: the same losses, gradient norms, validation loss and halting steps."""
import pytest

from tests.parallel.launch import one_process_reference, read_ranks, torchrun

pytestmark = pytest.mark.multiprocess
SCRIPT = "tests/parallel/run_layout.py"
CONFIG = "config=tiny_epsilon.yaml"
LAYER = "layers.1.epsilon"


@pytest.fixture(scope="module")
def epsilon_reference(tmp_path_factory):
    return one_process_reference(str(tmp_path_factory.mktemp("ref_epsilon")), CONFIG)


@pytest.mark.parametrize("layout", [["parallel.tp=2", "zero_stage=1"], ["zero_stage=3"]],
                         ids=["tp2-zero1", "dp2-zero3"])
def test_epsilon_layouts_match_one_process(tmp_path, epsilon_reference, layout):
    torchrun(2, SCRIPT, [str(tmp_path), CONFIG, *layout], timeout=400)
    ranks = read_ranks(str(tmp_path))
    reference = epsilon_reference
    assert len(ranks) == 2
    for r in ranks:
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    steps = [[s["iterations"][LAYER] for s in r["steps"]] for r in ranks]
    if "parallel.tp=2" in layout:      # the shards agree, and take the very steps of one process
        assert steps[0] == steps[1] == [s["iterations"][LAYER] for s in reference["steps"]]
    else:                              # each rank ran its own micro-batch of every global batch
        for a, b, ref in zip(steps[0], steps[1], reference["steps"]):
            assert a + b == ref["iterations"][LAYER]
