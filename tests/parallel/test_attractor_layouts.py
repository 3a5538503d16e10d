"""The ``attractor`` layer (configs/tiny_attractor.yaml: Attractor's solve made causal, per token, with Anderson
mixing; Neumann-1 backward) trained 5
steps on parallel layouts against one process (fp32): TP2 x DP2 ZeRO-1 at d 32, and DP2 ZeRO-3 at d 256,
where the head's stacked weights (>= 393k elements) lie above ZeRO-3's persistence threshold and are
partitioned and gathered: the whole solve runs inside the layer's one forward, so ranks that iterate a
different number of times never disagree on a collective.

TP2 x DP2 solves to a fixed depth (``PINNED``: tol 0, 8 iterations, every token): with the recipe's tolerance
stop (3e-3, per token) a token of the split run could stop one Anderson iteration apart from one process's
under another summation order, and the loss then moved by ~1e-5 relative (issue 49: 3.3917336 against
3.3917717 at its tolerance 1e-5, a first step equal to 2e-8). Pinned, nothing discrete is left in the solve
and a rank that computes anything else still fails the comparison. DP2 ZeRO-3 keeps the tolerance stop: its
point is ranks that iterate a different number of times (issue 49 left it so, unflipped so far)."""
import pytest

from tests.parallel.launch import layout_cases, read_ranks, torchrun

SCRIPT = "tests/parallel/run_layout.py"
PINNED_ITERS = 8
PINNED = ["solver.tol=0", f"solver.max_iter={PINNED_ITERS}"]      # a fixed depth: no tolerance decision to flip
LAYOUTS = {"tp2xdp2-zero1": (4, ["parallel.tp=2", "zero_stage=1"], PINNED),
           "dp2-zero3-d256": (2, ["zero_stage=3"], ["model.d_model=256", "parallel.timeout_s=120"])}


def common(name: str) -> list[str]:
    return ["config=tiny_attractor.yaml", *LAYOUTS[name][2]]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    """Both layouts' one-process references, one after the other in one process (300 s each)."""
    cases = layout_cases(1, tmp_path_factory.mktemp("one"), {name: common(name) for name in LAYOUTS})
    return {name: ranks[0] for name, ranks in cases.items()}


def assert_matches(ranks, reference, nproc):
    assert len(ranks) == nproc
    for r in ranks:
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300 * len(LAYOUTS) + 400 + 60)     # the first test waits for ``references``, then its launch
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_attractor_layouts_match_one_process(tmp_path, references, name):
    nproc, layout, _ = LAYOUTS[name]
    (tmp_path / "split").mkdir()
    reference = references[name]
    assert all(s["iterations"]["layers.3.attractor"] for s in reference["steps"])
    torchrun(nproc, SCRIPT, [str(tmp_path / "split"), *layout, *common(name)], timeout=400)
    ranks = read_ranks(str(tmp_path / "split"))
    if LAYOUTS[name][2] == PINNED:
        for run in [reference, *ranks]:
            assert {n for s in run["steps"] for n in s["iterations"]["layers.3.attractor"]} == {PINNED_ITERS}
    assert_matches(ranks, reference, nproc)
    if "zero_stage=3" in layout:
        assert ranks[0]["checked_collectives"]["all_gather_into_tensor"] > 0
