"""Turn a plain LoopedLM into its tensor-parallel shard, in place (Megatron-style).

    model = parallelize(build_model(cfg), state)    # every rank built the same full model first

The model code knows nothing of TP: each module that may be split has a ``shards`` seam
(``fpscale.models.common.Unsharded``, the identity) where its shards meet. This step keeps this
rank's slice of every split weight and puts ``TensorParallelShards`` (the conjugate collectives)
into those seams.

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
import torch.nn.functional as F

from fpscale.models.attn import Attention
from fpscale.models.common import MLP, swiglu_hidden
from fpscale.models.fpmamba import FPMambaMixer
from fpscale.models.fpsa import FPSAttention
from fpscale.models.looped import LoopedCore
from fpscale.parallel.layers import (mark_tensor_parallel, shard, vocab_parallel_cross_entropy,
                                     vocab_parallel_embedding)
from fpscale.parallel.mappings import (_all_reduce, copy_to_tp, gather_from_tp, reduce_from_tp,
                                       scatter_to_tp)
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
    """Every split dimension must divide by the TP size; the error names the numbers."""
    types = {spec.type for spec in cfg.layers}
    checks = []
    if types & {"attn", "fpsa", "looped"} or any(spec.type == "fpmamba" and spec.mlp for spec in cfg.layers):
        checks += [("model.n_heads", cfg.n_heads),
                   ("the SwiGLU hidden size", swiglu_hidden(cfg.d_model, cfg.mlp_ratio))]
    for i, spec in enumerate(cfg.layers):
        if spec.type == "fpmamba":
            checks.append((f"d_inner of model.layers.{i} (expand {spec.expand} x d_model {cfg.d_model})",
                           spec.expand * cfg.d_model))
    checks.append(("model.vocab_size", cfg.vocab_size))
    for name, value in checks:
        if value % tp:
            raise ValueError(f"{name} = {value} is not divisible by parallel.tp = {tp}")


def split(owner: torch.nn.Module, name: str, rank: int, tp: int, dim: int, parts: int = 1) -> None:
    """Replace parameter (or buffer) ``owner.name`` by this rank's slice (see ``layers.shard``)."""
    whole = getattr(owner, name)
    local = shard(whole.data, dim, rank, tp, parts)
    if isinstance(whole, torch.nn.Parameter):
        local = torch.nn.Parameter(local, requires_grad=whole.requires_grad)
        setattr(owner, name, local)
    else:
        owner.register_buffer(name, local)
    mark_tensor_parallel(local, dim, parts)


def _split_heads_mlp_attention(m: Attention, rank: int, tp: int) -> None:
    split(m, "w_qkv", rank, tp, 0, parts=3)          # [q; k; v], each split by heads
    split(m, "w_o", rank, tp, 1)


def _split_mlp(m: MLP, rank: int, tp: int) -> None:
    split(m, "w_gate", rank, tp, 0)
    split(m, "w_up", rank, tp, 0)
    split(m, "w_down", rank, tp, 1)


def _split_fpsa(m: FPSAttention, rank: int, tp: int) -> None:
    for name in ("w_q", "w_k", "w_v", "u_q", "u_k"):          # rows are heads
        split(m, name, rank, tp, 0)
    split(m, "w_o", rank, tp, 1)
    if m.log_temp is not None:
        split(m, "log_temp", rank, tp, 0)


def _split_looped(m: LoopedCore, rank: int, tp: int) -> None:
    split(m, "w_qkv", rank, tp, 1, parts=3)
    split(m, "w_o", rank, tp, 2)
    split(m, "w_gate", rank, tp, 1)
    split(m, "w_up", rank, tp, 1)
    split(m, "w_down", rank, tp, 2)


def _split_fpmamba(m: FPMambaMixer, rank: int, tp: int) -> None:
    di = m.d_inner
    split(m, "w_in", rank, tp, 0, parts=2)                     # [x channels; gate channels]
    for name in ("conv_w", "conv_b", "dt_proj", "dt_bias", "A_log", "D", "out_norm_w"):
        split(m, name, rank, tp, 0)
    for name in ("x_proj", "y_proj", "w_out"):
        if getattr(m, name) is not None:
            split(m, name, rank, tp, 1)
    if m.mixer in ("householder", "dplr"):
        for name, p in m.mixer_params().items():
            if name.startswith("mix_u_"):                  # [rank * di, di]: rows of each u_i
                split(m, name, rank, tp, 0, parts=p.shape[0] // di)
            elif name.startswith("mix_a_") and p.dim() == 2:   # [rank, di]: w . x summed over shards
                split(m, name, rank, tp, 1)
    # Kronecker: its factors mix all channels; the mixer gathers and keeps the parameters whole


def parallelize(model, state, tracker: RNGTracker | None = None):
    """Split ``model`` for this rank; ``tracker`` holds the per-shard random stream (dropout
    inside TP regions), by default one seeded from the model's seed."""
    tp = state.tp_size
    if tp == 1:
        return model
    check_divisibility(model.cfg, tp)
    tracker = tracker or RNGTracker.for_tp(model.seed, state)
    rank, group = state.tp_rank, state.tp_group
    splitters = ((Attention, _split_heads_mlp_attention), (MLP, _split_mlp), (FPSAttention, _split_fpsa),
                 (LoopedCore, _split_looped), (FPMambaMixer, _split_fpmamba))
    for module in model.layers.modules():
        for kind, split_module in splitters:
            if isinstance(module, kind):
                split_module(module, rank, tp)
                module.shards = TensorParallelShards(group, tracker)
    split(model.embed, "weight", rank, tp, 0)
    if model.lm_head is not None:
        split(model, "lm_head", rank, tp, 0)
    embed = model.embed
    embed.forward = lambda tokens: vocab_parallel_embedding(tokens, embed.weight, group)
    model.output = lambda h: F.linear(copy_to_tp(h, group), model.head_weight())
    model.cross_entropy = lambda logits, targets: vocab_parallel_cross_entropy(
        logits.flatten(0, 1), targets.flatten(), group)
    model.sharded_logits = True          # each rank holds a vocabulary slice: not decodable as is
    return model
