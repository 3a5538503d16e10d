"""What a run has done so far, beside its weights and optimizer: the step, the position in the
sample stream, the updates skipped and the random streams.

The trainer holds one ``TrainState``; a checkpoint saves its ``state_dict`` (the counters in
meta.json, each rank's streams in its rank file) and a resume puts it back with
``load_state_dict``, so that a resumed run draws the samples and dropout masks the
uninterrupted run would.

    progress = TrainState(batches, rng)
    sd = progress.state_dict()      # {"step", "consumed_samples", "skipped_steps", "rng"}
    progress.load_state_dict(sd)
"""
from __future__ import annotations

from dataclasses import dataclass

from fpscale.data.loader import DistributedBatches
from fpscale.parallel.random import RNGTracker, load_rng_state, rng_state, seed_default_stream

COUNTERS = ("step", "consumed_samples", "skipped_steps")


@dataclass
class TrainState:
    """``batches`` is the run's loader (its ``consumed_samples`` is the position in the sample
    stream, advanced by every global batch); ``rng`` is the tracker the model's tensor-parallel
    layers draw from (the same object: loading replaces its streams in place)."""

    batches: DistributedBatches
    rng: RNGTracker
    step: int = 0
    skipped_steps: int = 0

    @property
    def consumed_samples(self) -> int:
        return self.batches.consumed_samples

    def counters(self) -> dict[str, int]:
        """The layout-independent part: step, consumed_samples, skipped_steps."""
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The counters and this rank's random streams (the tracker's and the default ones of
        torch, numpy and python); loads with ``torch.load(weights_only=True)``."""
        return {**self.counters(), "rng": rng_state(self.rng, self.rng.device)}

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``. Without ``sd["rng"]`` (a resume on another layout: these ranks
        saved no streams) the streams are left alone; ``reseed`` restarts them."""
        self.step, self.skipped_steps = sd["step"], sd["skipped_steps"]
        self.batches.consumed_samples = sd["consumed_samples"]
        if "rng" in sd:
            load_rng_state(sd["rng"], self.rng, self.rng.device)

    def reseed(self, seed: int, state) -> None:
        """Restart every random stream from ``seed + step``, as a fresh run seeded so would start
        them: the same on every layout."""
        seed_default_stream(seed + self.step, state)
        self.rng.states = RNGTracker.for_tp(seed + self.step, state).states
