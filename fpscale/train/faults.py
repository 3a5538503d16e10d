"""Fault injection for the crash-safety and chaos tests (tests/train/test_chaos.py, bench/chaos.py).

The trainer marks where it is (``at(phase, step)``); ``FPSCALE_FAULT`` names a signal, a phase of a
step, an optional delay and the rank that gets it:

    FPSCALE_FAULT=SIGKILL@hash:4              rank 0 dies as step 4's save starts hashing (shards
                                              written, nothing published)
    FPSCALE_FAULT=SIGTERM@step:7+0.35,rank=1  rank 1 gets SIGTERM 0.35 s after step 7 began,
                                              wherever the run is by then

Phases: ``step`` (optimizer step N begins), ``val`` (the validation at step N begins), ``save``
(the save of step N begins), ``hash`` (its shards are written; hashing and publishing follow).
With a delay the signal comes from a timer thread, at a moment the main thread does not choose
(inside a collective, a write, a rename). Before it fires, the process prints one line,
``fault: SIGKILL to rank 1 (pid 123) at save of step 8 (asked: step:7+0.35)``, naming where
the run was, so a schedule's outcome can be read back. Unset (always, outside tests): ``at``
only records the phase.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
from dataclasses import dataclass

SPEC = re.compile(r"^(SIG[A-Z0-9]+)@(step|val|save|hash):(\d+)(?:\+([0-9.]+))?(?:,rank=(\d+))?$")


@dataclass(frozen=True)
class Fault:
    signal: signal.Signals
    phase: str
    step: int
    delay_s: float = 0.0
    rank: int = 0

    @staticmethod
    def parse(spec: str) -> "Fault":
        m = SPEC.match(spec.strip())
        if not m:
            raise ValueError(f"FPSCALE_FAULT={spec!r}: expected SIGNAL@PHASE:STEP[+DELAY_S][,rank=R] with PHASE "
                             f"one of step, val, save, hash (e.g. SIGKILL@save:4+0.2,rank=1)")
        sig, phase, step, delay, rank = m.groups()
        return Fault(signal.Signals[sig], phase, int(step), float(delay or 0.0), int(rank or 0))

    def __str__(self) -> str:
        return f"{self.signal.name}@{self.phase}:{self.step}+{self.delay_s:g},rank={self.rank}"


_where = ("start", 0)
_armed: Fault | None = None
_parsed = False


def _fault() -> Fault | None:
    global _armed, _parsed
    if not _parsed:
        _parsed = True
        spec = os.environ.get("FPSCALE_FAULT", "")
        if spec:
            fault = Fault.parse(spec)
            if fault.rank == int(os.environ.get("RANK", "0")):
                _armed = fault
    return _armed


def at(phase: str, step: int) -> None:
    """The run enters ``phase`` of ``step``; fires the armed fault when it names this moment."""
    global _where, _armed
    _where = (phase, step)
    fault = _fault()
    if fault is None or (fault.phase, fault.step) != (phase, step):
        return
    _armed = None                      # once
    if fault.delay_s <= 0:
        _fire(fault)
    else:
        threading.Timer(fault.delay_s, _fire, args=(fault,)).start()


def _fire(fault: Fault) -> None:
    phase, step = _where
    print(f"fault: {fault.signal.name} to rank {fault.rank} (pid {os.getpid()}) at {phase} of step {step} "
          f"(asked: {fault.phase}:{fault.step}+{fault.delay_s:g})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), fault.signal)
