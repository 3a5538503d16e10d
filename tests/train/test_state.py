"""TrainState: its state_dict puts back the counters and every random stream; reseed restarts them."""
import random

import numpy as np
import torch

from fpscale.data.loader import DistributedBatches
from fpscale.data.synthetic import SyntheticTask
from fpscale.parallel.random import RNGTracker, seed_default_stream
from fpscale.parallel.state import ParallelState
from fpscale.train.state import TrainState


def draws(progress: TrainState) -> list:
    with progress.rng.fork():
        tp = torch.rand(3)
    return [tp, torch.rand(3), np.random.rand(3), random.random(), progress.batches.next_global_batch()[0]]


def test_state_dict_round_trip_continues_every_stream():
    state = ParallelState()
    task = SyntheticTask("periodic", 16, 8, 0, 3)
    progress = TrainState(DistributedBatches(task, 4, 2, seed=0), RNGTracker.for_tp(0, state))
    progress.step, progress.skipped_steps = 7, 1
    draws(progress)
    saved = progress.state_dict()
    assert {k: saved[k] for k in ("step", "consumed_samples", "skipped_steps")} == \
        {"step": 7, "consumed_samples": 4, "skipped_steps": 1} == progress.counters()
    want = draws(progress)
    progress.step, progress.skipped_steps = 0, 0
    progress.load_state_dict(saved)
    got = draws(progress)
    assert (progress.step, progress.skipped_steps, progress.consumed_samples) == (7, 1, 8)
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_reseed_restarts_the_streams_from_seed_plus_step():
    state = ParallelState()
    task = SyntheticTask("periodic", 16, 8, 0, 3)
    resumed = TrainState(DistributedBatches(task, 4, 2, seed=0), RNGTracker.for_tp(0, state), step=5)
    resumed.reseed(10, state)
    got = draws(resumed)[:4]
    seed_default_stream(15, state)
    fresh = TrainState(DistributedBatches(task, 4, 2, seed=0), RNGTracker.for_tp(15, state))
    for a, b in zip(got, draws(fresh)[:4]):
        assert np.array_equal(np.asarray(a), np.asarray(b))
