"""A rank that vanishes is named: its heartbeat stops, and every other rank exits within
parallel.timeout_s with exit code 69 and a message naming it (or, when the vanished rank hosted
the rendezvous store, naming the store). The ranks start without a launcher that would end the
others (as ``srun --kill-on-bad-exit=0`` does on a cluster)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from fpscale.errors import EXIT_PEER_LOST
from fpscale.parallel.heartbeat import Heartbeat, timings
from tests.parallel.launch import ROOT, free_port

TIMEOUT_S = 10


class CountingStore:
    def __init__(self):
        self.values = {}

    def add(self, key, n):
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def get(self, key):
        return b"node7 pid 42"


def test_timings_follow_the_collective_timeout():
    assert timings(10) == pytest.approx((1 / 3, 10 / 3))
    assert timings(300) == (2.0, 60.0)
    interval, grace = timings(0.5)
    assert interval == 0.2 and grace == pytest.approx(1.0)


def test_the_watcher_names_the_rank_whose_counter_stood_still():
    store = CountingStore()
    beat = Heartbeat(store, rank=0, world=3, timeout_s=0.5)       # grace 1 s
    beat._check()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.2:
        store.add("fpscale/heartbeat/1", 1)                       # rank 1 beats, rank 2 does not
        beat._check()
        time.sleep(0.1)
    assert beat.lost is not None and beat.lost.startswith("rank 2 (node7 pid 42) vanished")


def start_ranks(tmp_path, world: int) -> list[subprocess.Popen]:
    port = free_port()
    args = ["--config", "configs/tiny_mixed.yaml", "data.source=synthetic", "data.seq_len=16", "model.vocab_size=32",
            "model.d_model=32", "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=8",
            "train.steps=100000", "train.log_interval=1", "train.eval_interval=100000", "parallel.zero_stage=1",
            f"parallel.timeout_s={TIMEOUT_S}", f"train.out_dir={tmp_path}", "name=hb"]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "launch/pretrain.py", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim, says", [(1, "rank 1 ("), (0, "rendezvous store")])
def test_the_other_ranks_exit_within_the_timeout_naming_the_rank_that_vanished(tmp_path, victim, says):
    procs = start_ranks(tmp_path, 2)
    try:
        metrics = tmp_path / "hb" / "metrics.jsonl"
        deadline = time.time() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "training did not start"
            time.sleep(0.2)
        os.kill(procs[victim].pid, signal.SIGKILL)         # mid-training: inside a step or its collectives
        t0 = time.time()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=TIMEOUT_S + 30)
        took = time.time() - t0
        assert survivor.returncode == EXIT_PEER_LOST, err[-3000:]
        last = [line for line in err.splitlines() if line.startswith("error: ")][-1]
        assert says in last and "vanished" in last, last
        assert took < TIMEOUT_S, f"took {took:.1f} s"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


EXIT_WHILE_BEATING = """
import os, sys, time
import torch.distributed as dist
from fpscale.parallel import heartbeat
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
heartbeat.timings = lambda timeout_s: (0.0, 5.0)      # beat without pause: the thread lives in store.add
heartbeat.Heartbeat.start(0, 1, 10)
time.sleep(0.3)
dist.destroy_process_group()
if sys.argv[2] == "raise":
    raise SystemExit(3)                               # an error path: nobody calls stop()
"""


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_process_that_exits_while_its_heartbeat_is_in_a_store_call_exits_cleanly(ending):
    """Issue 49's abort: a daemon thread inside a store call when Python finalizes is ended by
    pthread_exit from pybind11's gil_scoped_release destructor -> std::terminate, SIGABRT
    (pytorch/pytorch#38228). Before the atexit join this script aborted 6 times out of 6."""
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_BEATING, str(free_port()), ending], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == (0 if ending == "return" else 3), proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr
