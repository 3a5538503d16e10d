"""The tensor-parallel primitives on 2 processes match the dense computation (float64)."""
import os

import pytest

from tests.parallel.launch import torchrun

pytestmark = pytest.mark.multiprocess


def test_tp_primitives_match_dense(tmp_path):
    torchrun(2, "tests/parallel/run_tp_primitives.py", [str(tmp_path)], timeout=180)
    assert os.path.exists(tmp_path / "ok")
