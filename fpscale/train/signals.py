"""What every rank decides together at a step boundary: a preemption save, a save on the timer.

    boundary = StepBoundary(save_minutes=30)     # installs the signal handlers (main thread)
    ...after each optimizer step (boundary.restore() when the loop ends):
    preempted, timer_due = boundary.agree(state)  # one small all-reduce, the same answer everywhere
    if preempted: save; exit with EXIT_PREEMPTED
    if timer_due: save (then boundary.saved())

SIGTERM or SIGUSR1 on any rank asks for a checkpoint at the next step boundary, then an exit.
SLURM sends SIGUSR1 ahead of the time limit (``--signal=USR1@120``) and SIGTERM on preemption or
``scancel``; either way the run saves and exits with ``fpscale.errors.EXIT_PREEMPTED`` = 75 (sysexits'
EX_TEMPFAIL: "try again later"), which a job script can requeue on. An uncatchable end (SIGKILL,
a node that dies) saves nothing: the save timer (``train.save_interval_minutes``, read on rank 0's
clock, as Huginn and Parcae save) and ``train.save_interval`` bound what it loses.
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class StepBoundary:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, save_minutes: float = 0.0):
        self.received: int | None = None
        self.save_s = 60.0 * save_minutes
        self.last_save = time.monotonic()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def restore(self) -> None:
        """Put back the handlers there were before (the training loop ends): a process that goes
        on (a test, a notebook, a worker it forks) must not keep swallowing SIGTERM."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def saved(self) -> None:
        """A checkpoint was just written: the timer starts again."""
        self.last_save = time.monotonic()

    def agree(self, state) -> tuple[bool, bool]:
        """(any rank got a signal, rank 0's save timer is due): the same on every rank, from one
        MAX all-reduce of two flags."""
        timer_due = state.is_main and self.save_s > 0 and time.monotonic() - self.last_save >= self.save_s
        flags = torch.tensor([int(self.received is not None), int(timer_due)], device=state.device)
        if state.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        preempted, due = flags.tolist()
        return bool(preempted), bool(due)
