"""Tensor-parallel building blocks on sharded weights (functional, like the model code).

    column_parallel_linear   W split by output rows: y_local = x W_local^T      (input copied)
    row_parallel_linear      W split by input columns: y = sum_ranks x_local W_local^T
    vocab_parallel_embedding the table split by vocabulary rows; the ranks' lookups are summed
    vocab_parallel_cross_entropy  CE over vocabulary-sharded logits; full logits never gathered
    (VocabParallelLMHead.chunked_loss: the same from the hidden states, a chunk of tokens at a time)
    VocabParallelEmbedding, VocabParallelLMHead   the modules parallelize swaps into the model
    shard / unshard          a rank's slice of a whole tensor, and the whole from every slice
    global_grad_norm         the whole model's gradient norm from split and replicated parameters
Sharded parameters carry ``tensor_model_parallel = True`` (DeepSpeed then counts them once in
the gradient norm), ``partition_dim`` and ``tp_parts`` (how to merge and re-split them).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpscale.models.heads import LMHead
from fpscale.ops.chunked_loss import chunked_cross_entropy
from fpscale.parallel.mappings import _all_reduce, copy_to_tp, reduce_from_tp


def _parts_view(shape, dim: int, parts: int) -> list[int]:
    """``shape`` with dimension ``dim`` seen as ``parts`` equal sub-tensors: [..., parts, size/parts, ...]."""
    return [*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1:]]


def shard(whole: torch.Tensor, dim: int, rank: int, world: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice of ``whole`` along ``dim``. With ``parts`` > 1 the dimension holds that many
    equal sub-tensors (fused q/k/v: 3) and each is split on its own, so rank r keeps its slice of
    q, of k and of v, in that order."""
    if whole.shape[dim] % (parts * world):
        raise ValueError(f"dimension {dim} of size {whole.shape[dim]} ({parts} part(s)) is not divisible "
                         f"by the TP size {world}")
    local_shape = list(whole.shape)
    local_shape[dim] //= world
    view = whole.reshape(_parts_view(whole.shape, dim, parts))
    return view.chunk(world, dim + 1)[rank].reshape(local_shape).clone()


def unshard(pieces: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard`: the whole tensor from every rank's slice, in rank order."""
    whole_shape = list(pieces[0].shape)
    whole_shape[dim] *= len(pieces)
    views = [p.reshape(_parts_view(p.shape, dim, parts)) for p in pieces]
    return torch.cat(views, dim + 1).reshape(whole_shape)


def mark_tensor_parallel(t: torch.Tensor, dim: int, parts: int = 1) -> torch.Tensor:
    """Tag a split tensor: DeepSpeed counts it once in the gradient norm; checkpoints merge it."""
    for name, value in (("tensor_model_parallel", True), ("partition_dim", dim), ("tp_parts", parts)):
        setattr(t, name, value)
    return t


def global_grad_norm(params, tp_group) -> torch.Tensor:
    """L2 norm of the gradients of the whole model from one TP rank's parameters: the squares of
    split parameters (``tensor_model_parallel``) are summed over the TP group, replicated ones
    counted once. Gradients must already be reduced over data parallelism. One fp32 sum of
    squares per group of parameters on their device (no host transfer), one all-reduce."""
    squares: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for p in params:
        if p.grad is not None:
            squares[bool(getattr(p, "tensor_model_parallel", False))].append(p.grad.detach())
    device = next((g.device for group in squares.values() for g in group), torch.device("cpu"))

    def sum_sq(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()

    split, whole = sum_sq(squares[True]), sum_sq(squares[False])
    return (_all_reduce(split, tp_group) + whole).sqrt()


def column_parallel_linear(x: torch.Tensor, w_local: torch.Tensor, group) -> torch.Tensor:
    return F.linear(copy_to_tp(x, group), w_local)


def row_parallel_linear(x_local: torch.Tensor, w_local: torch.Tensor, group) -> torch.Tensor:
    return reduce_from_tp(F.linear(x_local, w_local), group)


def vocab_parallel_embedding(tokens: torch.Tensor, table_local: torch.Tensor, group) -> torch.Tensor:
    rank = 0 if group is None else dist.get_rank(group)
    n = table_local.shape[0]
    start = rank * n
    local = tokens - start
    outside = (local < 0) | (local >= n)
    out = F.embedding(local.masked_fill(outside, 0), table_local)
    return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), group)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of [N, V/tp] logits over the TP group; ignore_index = -100."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        ctx.dtype = logits.dtype
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        rank = 0 if group is None else dist.get_rank(group)
        n_local = logits.shape[-1]
        start = rank * n_local
        gmax = _all_reduce(logits.max(dim=-1).values.detach(), group, dist.ReduceOp.MAX)
        shifted = logits - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(-1), group)
        valid = targets != -100
        local = targets - start
        mine = valid & (local >= 0) & (local < n_local)
        idx = local.clamp(0, n_local - 1)
        target_logit = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1),
                                   torch.zeros_like(sum_exp))
        target_logit = _all_reduce(target_logit, group)
        losses = (sum_exp.log() - target_logit) * valid
        count = valid.sum().clamp_min(1)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), idx, mine, valid, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad = grad * (valid.unsqueeze(-1) * (g / count))
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    return _VocabParallelCE.apply(logits_local, targets, group)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose table is split by vocabulary rows: each rank looks up the tokens in its
    slice and the lookups are summed over the TP group (``weight`` keeps nn.Embedding's name)."""

    def __init__(self, weight_local: torch.nn.Parameter, group):
        super().__init__()
        self.weight, self.group = weight_local, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(tokens, self.weight, self.group)


class VocabParallelLMHead(LMHead):
    """The output layer over this rank's vocabulary slice of the weight: logits stay sharded and
    the loss is the vocabulary-parallel cross-entropy, so full logits are never gathered."""

    sharded_logits = True

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, h: torch.Tensor, weight_local: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(h, self.group), weight_local)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.group)

    def chunked_loss(self, h: torch.Tensor, weight_local: torch.Tensor, targets: torch.Tensor,
                     chunk: int) -> torch.Tensor:
        """The vocabulary-parallel cross-entropy chunk by chunk: [chunk, V/tp] logits at a time,
        their max, sum of exponentials and target logit all-reduced over the TP group; each rank's
        part of grad_h is summed over the group by copy_to_tp."""
        start = (0 if self.group is None else dist.get_rank(self.group)) * weight_local.shape[0]
        return chunked_cross_entropy(copy_to_tp(h, self.group), weight_local, targets, chunk, self.group, start)
