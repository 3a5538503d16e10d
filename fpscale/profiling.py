"""Device-independent measures of what a piece of code costs: the host-device synchronisations and aten
operations it makes (below), and the bytes autograd saves for backward (``count_saved_bytes``).

``count_host_reads()`` patches the methods that bring a tensor's value to the host (``item``,
``tolist``, ``__float__``, ``__int__``, ``__bool__``, ``__index__``, ``cpu``, ``numpy``): on a GPU
each is a synchronisation that leaves the device idle while the host waits and then launches
again. On a CPU ``.cpu()`` is a no-op, yet it counts: what is counted is what would synchronise
on a GPU. A read made inside another counted read (``tolist`` calling ``__float__``) counts once.

``count_syncs()`` counts everything that would make the host wait for the device (a training step's
measure: bench/profile_step.py): the reads above, plus, seen by a dispatch mode, the ops whose output
size depends on values (``nonzero``, ``masked_select``, ...) and copies from an accelerator to the host.

``count_aten_ops()`` counts the aten operations dispatched inside it (a TorchDispatchMode), each
a kernel launch on a GPU (views and metadata included: an upper bound on launches).

A kernel of fpscale's own (a Triton launch: ``opaque_kernel``) counts as one op and no read, which
is what it costs on a GPU: under Triton's interpreter on CPU its launch copies and reads tensors on
the host, and those are not counted.

    with count_host_reads() as reads:
        loss = model(x, targets=y); loss.backward()
    reads.total, reads.by_method
    with count_syncs() as syncs:
        trainer.train_step()
    syncs.total, syncs.by_kind       # {"Tensor.tolist": 1} (the methods) and {"aten.nonzero": ...} (the ops)
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
_ACTIVE: list = []          # the counters open now (HostReads, AtenOps)


class HostReads:
    """The reads counted so far: ``total`` and ``by_method``; ``marks`` lets a caller split them."""

    def __init__(self) -> None:
        self.by_method: Counter = Counter()
        self.depth = 0

    @property
    def total(self) -> int:
        return sum(self.by_method.values())


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the tensor-to-host reads made inside the block (not thread-safe: patches torch.Tensor)."""
    reads = HostReads()
    saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def wrap(name: str, method: Any) -> Any:
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if reads.depth == 0:
                reads.by_method[name] += 1
            reads.depth += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                reads.depth -= 1
        return counted

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    _ACTIVE.append(reads)
    try:
        yield reads
    finally:
        _ACTIVE.remove(reads)
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
            "aten._unique2", "aten.repeat_interleave")


class HostSyncs(TorchDispatchMode):
    """The host-device synchronisations counted inside ``count_syncs()``: ``total`` and ``by_kind``
    (``Tensor.<method>`` for the reads of ``count_host_reads``, ``aten.<op>`` for what the dispatch sees
    outside them: a read's own ``_local_scalar_dense`` is not counted twice)."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.ops: Counter = Counter()

    @property
    def by_kind(self) -> Counter:
        return Counter({f"Tensor.{name}": n for name, n in self.reads.by_method.items()}) + self.ops

    @property
    def total(self) -> int:
        return self.reads.total + sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten.{func.overloadpacket.__name__}"
        out = func(*args, **(kwargs or {}))
        if self.reads.depth == 0 and (name in SYNC_OPS or _to_host(name, args, kwargs or {}, out)):
            self.ops[name] += 1
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
    """Count what would make the host wait for the device inside the block, on any device: the reads of
    ``count_host_reads`` at the call (so a CPU run counts what a GPU run would wait for: ``.cpu()`` of a
    CPU tensor dispatches nothing), and the value-dependent ops and device-to-host copies made outside
    them. Not thread-safe (it patches ``torch.Tensor``)."""
    with count_host_reads() as reads, HostSyncs(reads) as mode:
        yield mode


class AtenOps(TorchDispatchMode):
    """A dispatch mode counting the aten operations run inside it (``total``, ``by_op``) and the bytes
    they move (``bytes``: the sizes of every tensor an op that is not a view reads or writes, its inputs
    and outputs, each once: the memory traffic of a kernel that streams them)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter = Counter()
        self.bytes = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket)] += 1
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not str(func.overloadpacket).startswith("aten.empty"):   # allocation: no traffic
            self.bytes += tensor_bytes(args, kwargs, out)
        return out


def tensor_bytes(*trees) -> int:
    """The bytes of every tensor in ``trees`` (nested tuples, lists and dicts)."""
    leaves = torch.utils._pytree.tree_leaves(trees)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def count_aten_ops() -> Iterator[AtenOps]:
    with AtenOps() as ops:
        _ACTIVE.append(ops)
        try:
            yield ops
        finally:
            _ACTIVE.remove(ops)


@contextlib.contextmanager
def opaque_kernel(name: str, moved: int = 0) -> Iterator[None]:
    """Around the launch of one of fpscale's own kernels: each open AtenOps counter counts it as
    the op ``name`` moving ``moved`` bytes, and nothing inside (the Triton interpreter's host
    copies) is counted."""
    if not _ACTIVE:
        yield
        return
    for counter in _ACTIVE:
        if isinstance(counter, AtenOps):
            counter.by_op[name] += 1
            counter.bytes += moved
        else:
            counter.depth += 1
    try:
        with torch.utils._python_dispatch._disable_current_modes():
            yield
    finally:
        for counter in _ACTIVE:
            if isinstance(counter, HostReads):
                counter.depth -= 1


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
