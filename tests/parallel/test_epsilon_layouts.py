"""The epsilon layer type (tiny_epsilon: attn, epsilon with HQSA, attn) on TP 2 and on DP 2 under
ZeRO-3 against one process: the same losses, gradient norms, validation loss and halting steps."""
import pytest

from tests.parallel.launch import layout_cases, one_process_reference

pytestmark = pytest.mark.multiprocess
CONFIG = "config=tiny_epsilon.yaml"
LAYER = "layers.1.epsilon"
LAYOUTS = {"tp2-zero1": ["parallel.tp=2", "zero_stage=1"], "dp2-zero3": ["zero_stage=3"]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """Both layouts on 2 ranks, one after the other in one launch (400 s each, as in their own)."""
    return layout_cases(2, tmp_path_factory.mktemp("eps"), {k: [CONFIG, *v] for k, v in LAYOUTS.items()},
                        timeout_each=400)


@pytest.fixture(scope="module")
def epsilon_reference(tmp_path_factory):
    return one_process_reference(str(tmp_path_factory.mktemp("ref_epsilon")), CONFIG)


@pytest.mark.timeout(400 * len(LAYOUTS) + 60)      # the first test waits for ``two_ranks``
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_epsilon_layouts_match_one_process(two_ranks, epsilon_reference, layout):
    ranks = two_ranks[layout]
    reference = epsilon_reference
    assert len(ranks) == 2
    for r in ranks:
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    steps = [[s["iterations"][LAYER] for s in r["steps"]] for r in ranks]
    if "parallel.tp=2" in LAYOUTS[layout]:      # the shards agree, and take the very steps of one process
        assert steps[0] == steps[1] == [s["iterations"][LAYER] for s in reference["steps"]]
    else:                              # each rank ran its own micro-batch of every global batch
        for a, b, ref in zip(steps[0], steps[1], reference["steps"]):
            assert a + b == ref["iterations"][LAYER]
