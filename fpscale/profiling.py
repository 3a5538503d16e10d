"""Device-independent measures: bytes saved for backward, counted by autograd itself; host-device
synchronisations, counted by a dispatch mode (``count_syncs``)."""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """One storage, however many tensors view it: (its StorageImpl, its bytes). Unlike the data
    pointer this also tells apart the storages of the meta device (all at address 0), where
    shapes and dtypes are real and nothing is computed (fpscale.train.memory_plan's loss head)."""
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class SavedBytes:
    """Running total of the bytes autograd saves for backward inside ``count_saved_bytes()``.

    Storages shared by several saved tensors (a parameter saved by two ops) are counted once.
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[tuple[int, int]] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t


@contextlib.contextmanager
def count_saved_bytes(exclude: tuple[torch.Tensor, ...] = ()) -> Iterator[SavedBytes]:
    """Count what the forward inside the block saves for backward.

    ``exclude``: tensors that live anyway (parameters, inputs) and should not count as
    activation memory.
    """
    counter = SavedBytes()
    for t in exclude:
        counter._seen.add(storage_key(t))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
            "aten._unique2", "aten.repeat_interleave")


class HostSyncs(TorchDispatchMode):
    """Host-device synchronisations counted inside ``count_syncs()``: ``total`` and ``by_kind``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter = Counter()
        self.depth = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten.{func.overloadpacket.__name__}"
        out = func(*args, **(kwargs or {}))
        if self.depth == 0 and (name in SYNC_OPS or _to_host(name, args, kwargs or {}, out)):
            self.by_kind[name] += 1
        return out


def _to_host(name: str, args, kwargs, out) -> bool:
    """A copy from an accelerator to the host (``x.to("cpu")``, ``cpu_tensor.copy_(cuda_tensor)``)."""
    if name == "aten._to_copy" and isinstance(out, torch.Tensor) and out.device.type == "cpu":
        return isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
    if name == "aten.copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


@contextlib.contextmanager
def count_syncs() -> Iterator[HostSyncs]:
    """Count what would make the host wait for the device inside the block, on any device: a dispatch
    mode sees the ops that read a value on the host (``aten._local_scalar_dense`` under ``.item()``,
    ``float(t)``, ``if t:``; ops whose output size depends on values, e.g. ``nonzero``) and copies to the
    host; the Tensor methods that read values (``tolist``, ``cpu``, ``numpy``, ``item``, ...) are counted
    at the call, so that a CPU run counts what a GPU run would wait for (``.cpu()`` of a CPU tensor is a
    no-op that dispatches nothing). A read inside another counted read counts once. Not thread-safe (it
    patches ``torch.Tensor``).

        with count_syncs() as syncs:
            trainer.train_step()
        syncs.total, syncs.by_kind
    """
    mode = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name: str, method):
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if mode.depth == 0:
                mode.by_kind[f"Tensor.{name}"] += 1
            mode.depth += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                mode.depth -= 1
        return counted

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        with mode:
            yield mode
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
