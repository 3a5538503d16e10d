"""A chaos test of training: runs on 2 and 4 processes (DP2 ZeRO-1; TP2 x DP2) killed 5 times or
more by SIGKILL or SIGTERM of a random rank at a random moment (a step, a validation, a save, its
hashing), each time resumed with ``resume: auto``, end bit-identical to the uninterrupted run:
losses, gradient norms, validation losses, final weights, data position. After every launch each
published checkpoint passes its manifest, and no launch recomputes more than one save interval.
The harness is bench/chaos.py (longer schedules: ``python bench/chaos.py``); the seed is printed
(``-s`` shows it) and kept in the failure message, so a failure replays with
``FPSCALE_CHAOS_SEED=<seed>``."""
import os
import random

import pytest

from bench.chaos import run_chaos

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("layout", ["zero1", "tp2xdp2"])
def test_a_run_interrupted_again_and_again_ends_as_the_uninterrupted_one(tmp_path, layout):
    seed = int(os.environ.get("FPSCALE_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
    lines = []
    report = run_chaos(layout, 5, seed, str(tmp_path), log=lambda line: (print(line), lines.append(line)))
    story = "\n".join(lines)
    assert not report["problems"], f"seed {seed}:\n{story}\n" + "\n".join(report["problems"])
    assert report["fired"] >= 5, f"seed {seed}: only {report['fired']} faults fired:\n{story}"
    assert report["max_recomputed"] <= report["save_interval"], story
