"""Collectives that refuse a tensor off the compute device, as NCCL refuses a CPU tensor.

    with checked_collectives(device) as seen:      # before the Trainer: DeepSpeed keeps references
        trainer = Trainer(cfg)
        with unnamed_device_is_meta():
            trainer.train_step()
    seen["all_reduce"]     # how many calls were checked

On a GPU every tensor fpscale hands to a collective must live on the GPU. On CPU the compute
device and the host are the same device, so the check alone could not fail; inside
``unnamed_device_is_meta`` the default device is therefore ``meta``: a tensor that fpscale (or
DeepSpeed) creates without naming its device lands on ``meta`` rather than the compute device, and
the collective it reaches refuses it, naming the collective and the caller. What the check
cannot see on CPU: an explicit ``.cpu()`` of a tensor that is already on the CPU.
"""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv", "_all_gather_base", "_reduce_scatter_base", "all_gather_single",
               "reduce_scatter_single")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class OffDeviceCollective(RuntimeError):
    pass


@contextlib.contextmanager
def checked_collectives(device: torch.device):
    """Every torch.distributed collective (as ``torch.distributed.X`` and in ``distributed_c10d``,
    where DeepSpeed looks some up) checks its tensors' device; yields a Counter of checked calls."""
    device = torch.device(device)
    seen: Counter = Counter()
    c10d = dist.distributed_c10d
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def checked(*args, **kwargs):
            for t in _tensors(list(args) + list(kwargs.values())):
                if t.device.type != device.type:
                    caller = "".join(traceback.format_stack(limit=4)[:-1])
                    raise OffDeviceCollective(f"torch.distributed.{name} was handed a tensor on {t.device} "
                                              f"(shape {tuple(t.shape)}), the compute device is {device}:\n{caller}")
            seen[name] += 1
            return fn(*args, **kwargs)
        return checked

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
        if getattr(c10d, name, None) is fn:
            setattr(c10d, name, getattr(dist, name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
            if hasattr(c10d, name):
                setattr(c10d, name, fn)


@contextlib.contextmanager
def unnamed_device_is_meta():
    """Tensors created without a device land on ``meta`` (no data): they cannot pass for the
    compute device, whatever it is."""
    with torch.device("meta"):
        yield
