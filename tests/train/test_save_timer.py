"""Saves on a timer (train.save_interval_minutes, read on rank 0's clock and agreed at the step
boundary) and the step-boundary decision itself; the signal handlers are put back afterwards."""
import os
import signal
import time

import fpscale
from fpscale.parallel.state import ParallelState
from fpscale.train.signals import StepBoundary
from fpscale.train.trainer import Trainer
from tests.train.test_resume import ROOT, TINY


def test_the_timer_is_due_only_on_rank_0_after_its_interval():
    main, other = ParallelState(), ParallelState(rank=1)
    boundary = StepBoundary(save_minutes=0.5 / 60)         # half a second
    try:
        assert boundary.agree(main) == (False, False)
        time.sleep(0.6)
        assert boundary.agree(main) == (False, True)
        assert boundary.agree(other) == (False, False)     # one clock decides (agree: MAX over ranks)
        boundary.saved()
        assert boundary.agree(main) == (False, False)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert boundary.agree(main) == (True, False)
    finally:
        boundary.restore()
    assert signal.getsignal(signal.SIGTERM) is not boundary._handle


def test_timed_saves_happen_between_step_saves_and_training_restores_sigterm(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    cfg = fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml"), TINY + [
        f"train.out_dir={tmp_path}", "name=timed", "train.save_interval=0", "train.keep_last=0",
        "train.save_interval_minutes=1e-9"])      # due after every step
    with Trainer(cfg, log=False) as trainer:
        trainer.train()
    saved = sorted(p for p in os.listdir(tmp_path / "timed" / "checkpoints") if p.startswith("step_"))
    assert saved == [f"step_{s:08d}" for s in range(1, 7)]
    assert signal.getsignal(signal.SIGTERM) is before
