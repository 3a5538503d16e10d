"""Turn a plain LoopedLM into its tensor-parallel shard, in place (Megatron-style).

    model = parallelize(build_model(cfg), state)    # every rank built the same full model first

The model code knows nothing of TP: each module that may be split declares how
(``tp_plan()``: weight name -> ``TPSplit(dim, parts)``) and has a ``shards`` seam
(``fpscale.layers.common.Unsharded``, the identity) where its shards meet. This step keeps this
rank's slice of every weight a plan names, puts ``TensorParallelShards`` (the conjugate
collectives) into those seams, and swaps in the vocabulary-parallel embedding and output head.
The divisibility each layer type needs comes from its spec (``tp_divisors``, the registry).

attn, fpsa    heads: q/k/v rows and W_O columns; MLP gate/up rows and down columns. fpsa's whole
              solve map f(z) = exit(attention of this rank's heads(enter(z))), so z stays whole
              and replicated; the spectral norm of the split W_Q, W_K uses the power iteration
              and sigma of the whole matrix (partial products summed); one temperature per head.
looped        the same per stacked sublayer (heads, MLP hidden); norms, a1, a2, conv replicated.
fpmamba       d_inner channels: in-projection rows, conv / dt / A / D / output norm per channel,
              x/y-projections and W_out by columns (partial sums), the channel mixer's u-vectors
              by rows over the gathered input (Householder / DPLR) or the whole Kronecker Q
              applied to the gathered state. Its solved state y is split, so the solver's norms
              are summed over the shards (``state_reduce``).
every solve   stop flags MAX-reduced over the TP group: all shards iterate the same count.
embeddings    the table split by vocabulary rows (vocab-parallel lookup); the tied output layer
              produces vocabulary-sharded logits and the loss is the vocab-parallel cross-entropy,
              so full logits are never gathered.
Split tensors carry ``tensor_model_parallel = True``, ``partition_dim`` and ``tp_parts`` (the number
of equal sub-tensors along that dim, each split on its own: 3 for fused q/k/v; ``layers.unshard``
merges), for DeepSpeed's gradient norm and for merging / re-splitting checkpoints.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fpscale.errors import LayoutError
from fpscale.parallel.layers import VocabParallelEmbedding, VocabParallelLMHead, mark_tensor_parallel, shard
from fpscale.parallel.mappings import _all_reduce, copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from fpscale.parallel.random import RNGTracker


class TensorParallelShards:
    """The collectives of a TP region over ``group`` (see ``Unsharded`` for the contract)."""

    def __init__(self, group, tracker: RNGTracker):
        self.group, self.tracker = group, tracker

    def rng(self):
        return self.tracker.fork()

    def enter(self, x):
        return copy_to_tp(x, self.group)

    def exit(self, x):
        return reduce_from_tp(x, self.group)

    def total(self, x):
        return copy_to_tp(reduce_from_tp(x, self.group), self.group)

    def gather(self, x):
        return gather_from_tp(x, self.group)

    def scatter(self, x):
        return scatter_to_tp(x, self.group)

    def consensus(self, flags: torch.Tensor) -> torch.Tensor:
        return _all_reduce(flags.clone(), self.group, dist.ReduceOp.MAX)

    def state_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return _all_reduce(t.clone(), self.group, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def check_divisibility(cfg, tp: int) -> None:
    """Every size a layer type splits (its ``tp_divisors``), and the vocabulary, must divide by the
    TP size; the error names the number and the layer."""
    checks = [(what, value, f" (model.layers.{i}, {spec.type}, splits it)")
              for i, spec in enumerate(cfg.layers) for what, value in spec.tp_divisors(cfg)]
    checks.append(("model.vocab_size", cfg.vocab_size, ""))
    for name, value, where in checks:
        if value % tp:
            raise LayoutError(f"{name} = {value} is not divisible by parallel.tp = {tp}{where}")


def split(owner: torch.nn.Module, name: str, rank: int, tp: int, dim: int, parts: int = 1) -> None:
    """Replace parameter (or buffer) ``owner.name`` by this rank's slice (see ``layers.shard``)."""
    whole = getattr(owner, name)
    local = shard(whole.data, dim, rank, tp, parts)
    if isinstance(whole, torch.nn.Parameter):
        local = torch.nn.Parameter(local, requires_grad=whole.requires_grad)
        if getattr(whole, "_no_weight_decay", False):      # the slice keeps what the layer marked
            setattr(local, "_no_weight_decay", True)
        setattr(owner, name, local)
    else:
        owner.register_buffer(name, local)
    mark_tensor_parallel(local, dim, parts)


def parallelize(model, state, tracker: RNGTracker | None = None):
    """Split ``model`` for this rank; ``tracker`` holds the per-shard random stream (dropout
    inside TP regions), by default one seeded from the model's seed."""
    tp = state.tp_size
    if tp == 1:
        return model
    check_divisibility(model.cfg, tp)
    tracker = tracker or RNGTracker.for_tp(model.seed, state)
    rank, group = state.tp_rank, state.tp_group
    for module in model.layers.modules():
        if hasattr(module, "tp_plan"):           # the weights it declares split
            for name, how in module.tp_plan().items():
                split(module, name, rank, tp, how.dim, how.parts)
        if hasattr(module, "shards"):            # every seam: a looped layer's solver agrees too
            module.shards = TensorParallelShards(group, tracker)
    split(model.embed, "weight", rank, tp, 0)
    model.embed = VocabParallelEmbedding(model.embed.weight, group)
    if model.lm_head is not None:
        split(model, "lm_head", rank, tp, 0)
    model.head = VocabParallelLMHead(group)      # each rank holds a vocabulary slice of the logits
    return model
