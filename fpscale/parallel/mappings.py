"""Conjugate autograd mappings between the tensor-parallel region and the rest (Megatron-style).

    copy_to_tp       forward: identity        backward: all-reduce (sum) over the TP group
    reduce_from_tp   forward: all-reduce      backward: identity
    gather_from_tp   forward: all-gather along the last dim   backward: keep the local slice
    scatter_to_tp    forward: keep the local slice            backward: all-gather
With a group of one process every mapping is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# Each mapping in torch.func's form (forward without ctx, ``setup_context``): torch.func.vjp can then
# differentiate an f that crosses them (``solver.adjoint.adjoint_step: vjp``)
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _gather_last(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _split_last(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x, group):
    return _ScatterToTP.apply(x, group)
