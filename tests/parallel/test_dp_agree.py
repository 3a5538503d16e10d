"""``solver.agree: dp`` (issue 27): on 16 CPU ranks at micro-batch 1, the stop decided over the DP
group equals one process running the 16 samples as one micro-batch (losses, DP-averaged gradients,
forward and adjoint iterations; fpsa, fpmamba, fpmamba2, looped, float64; and chunked, the counts summed
once per chunk, = the one process's eager loop), and the default per-rank stop on
the same samples shows the imbalance the trainer logs (tests/parallel/run_dp_agree.py)."""
import json

import pytest

import fpscale
from fpscale.errors import ConfigError
from tests.parallel.launch import torchrun


@pytest.mark.slow
@pytest.mark.multiprocess
def test_agree_dp_on_16_ranks_equals_one_process_with_the_16_samples(tmp_path):
    torchrun(16, "tests/parallel/run_dp_agree.py", [str(tmp_path)], timeout=400)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world"] == 16
    for name, case in report["cases"].items():
        assert case["agreed"] == case["one_process"], name
        assert case["chunked"] == case["one_process"], name          # solver.chunk: 4, agreed once per chunk


def test_agree_is_validated_with_its_key():
    with pytest.raises(ConfigError, match=r"solver.forward.agree"):
        fpscale.load_config(None, ["solver.agree=global"])
    assert fpscale.load_config(None, ["solver.agree=dp"]).solver.agree == "dp"
