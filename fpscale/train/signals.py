"""Preemption: SIGTERM or SIGUSR1 asks for a checkpoint at the next step boundary, then an exit.

    preemption = Preemption()              # installs the handlers (main thread)
    ...after each optimizer step:
    if preemption.agreed(state):           # MAX over all ranks: a signal on any rank stops all
        save; exit with EXIT_PREEMPTED

SLURM sends SIGUSR1 ahead of the time limit (``--signal=USR1@120``) and SIGTERM on preemption or
``scancel``; either way the run saves and exits with ``EXIT_PREEMPTED`` = 75 (sysexits'
EX_TEMPFAIL: "try again later"), which a job script can requeue on.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75


class Preemption:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, state) -> bool:
        """Whether any rank got a signal; every rank gets the same answer (one small all-reduce)."""
        flag = torch.tensor([int(self.received is not None)], device=state.device)
        if state.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
