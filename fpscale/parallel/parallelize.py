"""Turn a plain LoopedLM into its tensor-parallel shard, in place (Megatron-style).

    model = parallelize(build_model(cfg), state)    # every rank built the same full model first

attn blocks   q/k/v rows and W_O columns split by heads; MLP gate/up rows and down columns split;
              each sublayer's input goes through copy_to_tp and its output through reduce_from_tp
embeddings    the table split by vocabulary rows (vocab-parallel lookup); the tied output layer
              produces vocabulary-sharded logits and the loss is the vocab-parallel cross-entropy,
              so full logits are never gathered
Sharded parameters carry ``tensor_model_parallel = True``. Layer types whose solve needs a
collective inside its map (fpsa, fpmamba, looped) are not sharded yet: asking for them is an error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fpscale.models.attn import AttnBlock
from fpscale.models.common import swiglu_hidden
from fpscale.parallel.layers import (mark_tensor_parallel, shard, vocab_parallel_cross_entropy,
                                     vocab_parallel_embedding)
from fpscale.parallel.mappings import copy_to_tp, reduce_from_tp


def check_divisibility(cfg, tp: int) -> None:
    hidden = swiglu_hidden(cfg.d_model, cfg.mlp_ratio)
    for name, value in (("model.n_heads", cfg.n_heads), ("the SwiGLU hidden size", hidden),
                        ("model.vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"{name} = {value} is not divisible by parallel.tp = {tp}")
    for i, spec in enumerate(cfg.layers):
        if spec.type != "attn":
            raise ValueError(f"parallel.tp = {tp} shards attn layers only so far; model.layers.{i} is "
                             f"{spec.type!r} (run it with parallel.tp = 1)")


def _param(t: torch.Tensor, dim: int) -> torch.nn.Parameter:
    return mark_tensor_parallel(torch.nn.Parameter(t.contiguous()), dim)


def _wrap(module: torch.nn.Module, group) -> None:
    """Input copied into the TP region, partial outputs summed out of it."""
    inner = module.forward
    module.forward = lambda x, *args, **kw: reduce_from_tp(inner(copy_to_tp(x, group), *args, **kw), group)


def _shard_attn_block(block: AttnBlock, rank: int, tp: int, group) -> None:
    a, m = block.attn, block.mlp
    d = a.w_o.shape[0]
    heads = d // a.head_dim
    per = heads // tp
    qkv = a.w_qkv.data.view(3, heads, a.head_dim, d)[:, rank * per:(rank + 1) * per]
    a.w_qkv = _param(qkv.reshape(3 * per * a.head_dim, d), 0)
    a.w_o = _param(shard(a.w_o.data, 1, rank, tp), 1)
    m.w_gate = _param(shard(m.w_gate.data, 0, rank, tp), 0)
    m.w_up = _param(shard(m.w_up.data, 0, rank, tp), 0)
    m.w_down = _param(shard(m.w_down.data, 1, rank, tp), 1)
    _wrap(a, group)
    _wrap(m, group)


def parallelize(model, state):
    tp = state.tp_size
    if tp == 1:
        return model
    check_divisibility(model.cfg, tp)
    rank, group = state.tp_rank, state.tp_group
    for block in model.layers:
        _shard_attn_block(block, rank, tp, group)
    model.embed.weight = _param(shard(model.embed.weight.data, 0, rank, tp), 0)
    if model.lm_head is not None:
        model.lm_head = _param(shard(model.lm_head.data, 0, rank, tp), 0)
    embed = model.embed
    embed.forward = lambda tokens: vocab_parallel_embedding(tokens, embed.weight, group)
    model.output = lambda h: F.linear(copy_to_tp(h, group), model.head_weight())
    model.cross_entropy = lambda logits, targets: vocab_parallel_cross_entropy(
        logits.flatten(0, 1), targets.flatten(), group)
    model.sharded_logits = True          # each rank holds a vocabulary slice: not decodable as is
    return model
