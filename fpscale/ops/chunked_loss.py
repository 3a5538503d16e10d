"""The LM loss without the logits: cross-entropy of ``h W^T`` computed in chunks of tokens.

    loss = chunked_cross_entropy(h, weight, targets, chunk=4096)     # h [N, d], weight [V, d], targets [N]

The plain head (``LMHead.forward`` then ``loss``) makes the logits [N, V] and F.cross_entropy
saves their fp32 log-softmax for the backward: N x V x 4 bytes (3.07 GiB at 8 x 2048 tokens and
V = 50304). Here one ``torch.autograd.Function`` runs over ``chunk`` tokens at a time and saves
only references to ``h`` and ``weight``, the targets and each token's logsumexp (N floats); the
backward computes every chunk's logits again and forms (softmax - onehot) x g / count chunk by
chunk, then grad_h = G W and grad_W += G^T h. At most one chunk's logits [chunk, V] exist at a
time. The same math as the plain head, not an approximation:

  * the chunk's product runs in the compute dtype (the autocast dtype under autocast, as
    F.linear there: bf16; else the inputs' dtype), the logits are upcast and the softmax is in at
    least float32, and the gradient of the logits is rounded back to the compute dtype for the two
    products of the backward, as autograd does on the plain head;
  * ignore_index -100: such tokens neither count in the mean nor get a gradient. With no scored
    token at all the loss is 0 (the plain head's F.cross_entropy gives NaN there);
  * ``group`` (tensor parallelism): ``weight`` is this rank's vocabulary slice [V/tp, d] starting
    at row ``vocab_start``; each chunk's max, sum of exponentials and target logit are
    all-reduced over the group (as fpscale.parallel.layers.vocab_parallel_cross_entropy does), so
    a rank only ever holds [chunk, V/tp] logits. grad_h is then this rank's part of the sum over
    the vocabulary: the caller sums it over the group (copy_to_tp before the call).

The weight is an input of the Function (not a constant captured in it), so autograd delivers its
gradient and ZeRO-3 sees it used (the tied embedding is a registered external parameter).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(h, weight) would compute in here: the autocast dtype where autocast is on
    for h's device (float64 operands excepted, as autocast leaves them), else the inputs' dtype."""
    device = h.device.type
    if (torch.is_autocast_enabled(device) and h.dtype != torch.float64 and weight.dtype != torch.float64):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, group, vocab_start, dtype):
        soft = torch.promote_types(dtype, torch.float32)          # the softmax never below fp32
        n_local = weight.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            valid, mine, idx = _target_slots(targets, vocab_start, n_local)
            lse = torch.empty(h.shape[0], dtype=soft, device=h.device)
            losses = torch.empty_like(lse)
            for s in range(0, h.shape[0], chunk):
                e = min(s + chunk, h.shape[0])
                logits = F.linear(h[s:e].to(dtype), w).to(soft)
                top = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
                target = torch.where(mine[s:e], logits.gather(-1, idx[s:e, None]).squeeze(-1), 0.0)
                sum_exp = logits.sub_(top[:, None]).exp_().sum(-1)
                sum_exp, target = _all_reduce(torch.stack([sum_exp, target]), group)
                lse[s:e] = top + sum_exp.log()
                losses[s:e] = torch.where(valid[s:e], lse[s:e] - target, 0.0)
                del logits            # before the next chunk's: one chunk of logits at a time
            count = valid.sum().clamp_min(1)
        ctx.save_for_backward(h, weight, targets, lse, count)
        ctx.chunk, ctx.vocab_start, ctx.dtype = chunk, vocab_start, dtype
        return losses.sum() / count

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, lse, count = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dtype, chunk = ctx.dtype, ctx.chunk
        grad_h = grad_w = None
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            valid, mine, idx = _target_slots(targets, ctx.vocab_start, weight.shape[0])
            scale = torch.where(valid, g.to(lse.dtype) / count, 0.0)       # d loss / d loss_i
            if need_h:
                grad_h = torch.empty_like(h)
            for s in range(0, h.shape[0], chunk):
                e = min(s + chunk, h.shape[0])
                hc = h[s:e].to(dtype)
                p = F.linear(hc, w).to(lse.dtype).sub_(lse[s:e, None]).exp_()     # the softmax
                p.scatter_add_(-1, idx[s:e, None], -mine[s:e, None].to(p.dtype))   # - onehot
                grad = p.mul_(scale[s:e, None]).to(dtype)
                del p                 # one chunk of logits at a time (and no fp32 copy next to bf16 products)
                if need_h:
                    grad_h[s:e] = grad @ w
                if need_w:
                    part = grad.t() @ hc
                    # summed over the chunks in at least fp32 (one chunk: the plain head's rounding)
                    grad_w = part.to(torch.promote_types(lse.dtype, weight.dtype)) if grad_w is None \
                        else grad_w.add_(part)
                    del part
                del grad
            if grad_w is not None:
                grad_w = grad_w.to(weight.dtype)
            elif need_w:
                grad_w = torch.zeros_like(weight)
        return grad_h, grad_w, None, None, None, None, None


def _target_slots(targets: torch.Tensor, vocab_start: int, n_local: int):
    """Which targets are scored (not -100), which of them fall in this vocabulary slice, and their
    column in the slice (clamped into range for the others)."""
    valid = targets != IGNORE_INDEX
    local = targets - vocab_start
    mine = valid & (local >= 0) & (local < n_local)
    return valid, mine, local.clamp(0, n_local - 1)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          group=None, vocab_start: int = 0) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``targets`` (ignore_index -100),
    ``chunk`` tokens at a time, never holding more than one chunk's logits (module docstring).
    ``h`` [N, d] or [B, T, d] with ``targets`` of its leading shape; ``weight`` [V, d], or under
    tensor parallelism this rank's rows [vocab_start, vocab_start + V/tp) with the TP ``group``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 tokens, got {chunk}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"targets {list(targets.shape)} must have the leading shape of the hidden states "
                         f"{list(h.shape)}")
    return _ChunkedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk, group,
                                      vocab_start, compute_dtype(h, weight))
