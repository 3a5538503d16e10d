"""The chunked cross-entropy over a vocabulary split over TP 2 equals one process (float64):
the head alone, and a whole tiny model (tied and untied output layers) against the plain head."""
import os

import pytest

from tests.parallel.launch import torchrun

pytestmark = pytest.mark.multiprocess


def test_tp_chunked_loss_equals_one_process(tmp_path):
    torchrun(2, "tests/parallel/run_tp_chunked_loss.py", [str(tmp_path)], timeout=240)
    assert os.path.exists(tmp_path / "ok")
