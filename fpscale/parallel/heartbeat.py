"""Which rank vanished: a heartbeat per rank in the rendezvous store, and a watchdog that names a
rank whose heartbeat stopped.

    beat = Heartbeat.start(state.rank, state.world_size, timeout_s=cfg.parallel.timeout_s)
    ...                               # training; a peer that dies is named within timeout_s
    beat.stop_watching()              # before the last barrier: from there on ranks leave at will

A collective whose peer died does not say which rank it was: gloo reports "Connection closed by
peer [10.0.0.7]:41235", NCCL blocks until its timeout and aborts. Every rank therefore adds 1 to
its counter ``fpscale/heartbeat/<rank>`` in the job's rendezvous store every ``interval_s``, and
a watcher thread reads all counters; it keeps, per peer, the time the counter last moved on its
own clock (clocks are never compared across nodes). A peer whose counter has stood still for
``grace_s`` is reported by rank, host and pid, and this process exits with ``EXIT_PEER_LOST``
(69) from the watcher: the main thread may be inside a collective that nothing else ends. A
store that stops answering means its host is gone: rank 0's process (bare ``srun`` /
``deepspeed``) or the launcher (torchrun's agent). The times follow ``parallel.timeout_s``:
``interval_s`` = timeout/30 within [0.2, 2] s, ``grace_s`` = timeout/3 within [5 interval_s, 60 s],
so a vanished rank is named well within the collective timeout.

When the main thread fails on its own first (gloo's connection error comes at once), ``settle``
lets the watcher decide before the traceback, with a counter still for 4 beats as enough
evidence: fpscale.cli.reported calls it for every unexpected exception. Cost: one store ``add``
and one read of ``world`` counters per rank per ``interval_s`` (64 ranks at 2 s: 2,000 store
operations per second in all).

The thread is joined when the heartbeat stops, and at the interpreter's exit on any path (an
``atexit`` hook): a daemon thread still inside a store call when Python finalizes is ended by
``pthread_exit`` from pybind11's ``gil_scoped_release`` destructor, which aborts the process
("terminate called without an active exception", SIGABRT) after the run's work is done
(pytorch/pytorch#38228; it hit one rank of issue 49's chaos test under load).
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from fpscale.errors import EXIT_PEER_LOST, PeerLost, print_error

_active: "Heartbeat | None" = None


def timings(timeout_s: float) -> tuple[float, float]:
    """(interval_s, grace_s) for a collective timeout of ``timeout_s``."""
    interval = min(max(timeout_s / 30, 0.2), 2.0)
    grace = min(max(timeout_s / 3, 5 * interval), 60.0)
    return interval, grace


def _key(rank: int) -> str:
    return f"fpscale/heartbeat/{rank}"


class Heartbeat:
    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.interval_s, self.grace_s = timings(timeout_s)
        self.seen = {r: (-1, time.monotonic()) for r in range(world) if r != rank}   # value, when it moved
        self.lost: str | None = None
        self.watching = threading.Event()
        self.stopped = threading.Event()
        self.decided = threading.Event()
        self.main_reports = threading.Event()       # settle took the report over from the watcher
        self.thread: threading.Thread | None = None

    @classmethod
    def start(cls, rank: int, world: int, timeout_s: float) -> "Heartbeat":
        """Start beating and watching (every rank, after torch.distributed is initialised)."""
        global _active
        store = dist.distributed_c10d._get_default_store()     # the job's rendezvous store
        store = store.clone() if hasattr(store, "clone") else store     # a connection of its own
        beat = cls(store, rank, world, timeout_s)
        beat.store.set_timeout(datetime.timedelta(seconds=beat.grace_s))
        beat.store.set(f"fpscale/host/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        beat.store.add(_key(rank), 1)
        beat.watching.set()
        beat.thread = threading.Thread(target=beat._run, name="fpscale-heartbeat", daemon=True)
        beat.thread.start()
        atexit.register(beat.stop)
        _active = beat
        return beat

    def stop_watching(self) -> None:
        """Stop judging the peers (keep beating): call before the barrier that ends the run."""
        global _active
        self.watching.clear()
        if _active is self:
            _active = None

    def stop(self) -> None:
        """Stop beating and join the thread. A store call in flight returns within the store's
        timeout (``grace_s``); one whose store host is gone fails at once."""
        self.stop_watching()
        self.stopped.set()
        atexit.unregister(self.stop)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=self.grace_s + self.interval_s)
            if self.thread.is_alive():
                print_error(f"the heartbeat thread is still inside a store call {self.grace_s:.0f} s after it was "
                            f"stopped; the process may abort at exit")

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.store.add(_key(self.rank), 1)
                if self.watching.is_set():
                    self._check()
            except Exception as exc:          # the store is gone: its host died
                if self.watching.is_set():
                    self._give_up("the rendezvous store (MASTER_ADDR "
                                  f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}) stopped "
                                  f"answering ({type(exc).__name__}: {str(exc)[:120]}): its host vanished, rank 0's "
                                  f"process or the launcher")
                return

    def _check(self) -> None:
        now = time.monotonic()
        values = [int(self.store.add(_key(r), 0)) for r in self.seen]     # add 0: a read that never blocks
        for r, value in zip(list(self.seen), values):
            last, since = self.seen[r]
            if value != last:
                self.seen[r] = (value, now)
            elif now - since >= self.grace_s:
                self._give_up(self.describe(r, now - since))

    def describe(self, rank: int, silent_s: float) -> str:
        try:
            where = self.store.get(f"fpscale/host/{rank}").decode()
        except Exception:
            where = "host unknown"
        return (f"rank {rank} ({where}) vanished: its heartbeat stopped {silent_s:.0f} s ago (killed, out of "
                f"memory, its node failed, or it exited on an error: its own output says which); rank "
                f"{self.rank} stops too")

    def _give_up(self, why: str) -> None:
        self.lost = why
        self.decided.set()
        if threading.current_thread() is threading.main_thread():
            return
        time.sleep(min(self.interval_s, 1.0))     # the main thread may report it itself (settle)
        if self.main_reports.is_set():
            return
        print_error(why)
        try:
            sys.stdout.flush()                    # os._exit skips it: keep what the run printed
        except Exception:
            pass
        os._exit(EXIT_PEER_LOST)


def settle(exc: BaseException) -> None:
    """Called with the exception that ends a command: if a heartbeat is watching and a peer
    vanished (decided now, or within the grace time while some counter stands still), raise
    ``PeerLost`` naming it; otherwise return (the exception keeps its traceback)."""
    beat = _active
    if beat is None or not beat.watching.is_set():
        return
    # a peer that died a moment ago still looks fresh: wait until every counter has moved twice
    # (all alive: the exception is not about a lost peer) or the watcher names one. A collective
    # has failed, so a counter that stands still for 4 beats is enough evidence
    beat.main_reports.set()
    beat.grace_s = min(beat.grace_s, 4 * beat.interval_s)
    deadline = time.monotonic() + beat.grace_s + 2 * beat.interval_s
    start = {r: v for r, (v, _) in beat.seen.items()}
    while time.monotonic() < deadline:
        if beat.decided.wait(beat.interval_s):
            beat.watching.clear()
            raise PeerLost(beat.lost or "a peer vanished") from exc
        if all(beat.seen[r][0] >= v + 2 for r, v in start.items()):
            break
    beat.main_reports.clear()
