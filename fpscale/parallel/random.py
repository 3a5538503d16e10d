"""Random streams under tensor x data parallelism (Megatron's RNG tracker, for CPU and CUDA).

    default stream    seed_default_stream: seed + 100 * dp_rank for torch, numpy and python: the
                      same on the ranks of a TP group (a replicated activation gets the same
                      dropout mask on every shard), different on each data-parallel replica
    "tensor-parallel" RNGTracker.for_tp: seed + 2718 + tp_rank + 100 * dp_rank: a different mask on
                      each shard of a TP region (attention-probability dropout on this rank's heads)

    seed_default_stream(cfg.seed, state)          # after the model is built (same init everywhere)
    tracker = RNGTracker.for_tp(cfg.seed, state)
    with tracker.fork():                           # inside a TP region
        probs = F.dropout(probs, p)
Checkpoints save ``rng_state(tracker)`` (every stream, torch / numpy / python defaults included)
and ``load_rng_state`` puts it back, so a resumed run draws the masks the uninterrupted run would.
Everything in it is a tensor, int, str or tuple: it loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

TP_STREAM = "tensor-parallel"


def _get(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seed_default_stream(seed: int, state) -> None:
    base = seed + 100 * state.dp_rank
    random.seed(base)
    np.random.seed(base % 2 ** 32)
    torch.manual_seed(base)


class RNGTracker:
    """Named generator states swapped into the device's default generator by ``fork``."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def for_tp(cls, seed: int, state) -> "RNGTracker":
        tracker = cls(state.device)
        tracker.add(TP_STREAM, seed + 2718 + state.tp_rank + 100 * state.dp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        """Draw from stream ``name`` inside the block; the default stream is left where it was."""
        outer = _get(self.device)
        _set(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get(self.device)
            _set(outer, self.device)


def rng_state(tracker: RNGTracker | None, device: torch.device) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch_cpu": torch.get_rng_state(), "device": _get(device),
            "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
            "python": random.getstate(), "streams": dict(tracker.states) if tracker else {}}


def load_rng_state(sd: dict, tracker: RNGTracker | None, device: torch.device) -> None:
    torch.set_rng_state(sd["torch_cpu"])
    _set(sd["device"], device)
    kind, keys, pos, has_gauss, gauss = sd["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(sd["python"])
    if tracker is not None:
        tracker.states = dict(sd["streams"])
