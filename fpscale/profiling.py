"""Device-independent measures: bytes saved for backward, counted by autograd itself (the host-device
synchronisations and aten ops of a step: fpscale.solvers.host_reads)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


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
