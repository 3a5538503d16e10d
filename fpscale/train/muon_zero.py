"""Where each Muon matrix lies in the flat partitions DeepSpeed's optimizers hand fpscale's MuonAdamW.

DeepSpeed 0.19.8 wraps a client optimizer and steps it on flat fp32 tensors, one per parameter group
and rank, not on the parameters:
  ZeRO-1/2 (runtime/zero/stage_1_and_2.py)   ``single_partition_of_fp32_groups[i]``: rank r's slice
      [r S, (r+1) S) of the group's parameters flattened in order (``bit16_groups_flat[i]``, each
      parameter a view into it, so its offset is its data pointer's); the tail padded.
  bf16 (runtime/bf16_optimizer.py, ZeRO-0 and ZeRO-1 in bf16)   ``fp32_groups_flat_partition[i]``:
      the same contiguous slicing of ``bf16_groups_flat[i]``.
  bf16 without ZeRO (runtime/fp16/unfused_optimizer.py): whole fp32 copies of the parameters; only the
      TP marks are copied onto them.
  ZeRO-3 (runtime/zero/stage3.py)   ``fp32_partitioned_groups_flat[k]`` per sub-group k (stepped one
      at a time): the concatenation of its parameters' own partitions (``ds_tensor``, each parameter
      flattened and cut in ``partition_numel`` pieces, rank r the r-th, the last padded).
A matrix can thus be cut between ranks. ``FlatLayout`` gathers the group's (elementwise) Nesterov
update over the data-parallel group, rebuilds each matrix that touches this rank's partition,
hands it to the optimizer's ``orthogonalize`` (which gathers TP slices itself) and keeps this
rank's part. Every TP rank of a DP rank has the same layout, so they take part in the same TP
gathers in the same order. DeepSpeed's own Muon (runtime/zero/muon/) does this inside the ZeRO
optimizers (``get_flat_partition``) for its MuonWithAuxAdam; it orthogonalises the TP slice as if
it were the matrix (no TP handling), hence this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class Piece:
    param: torch.nn.Parameter      # the model's parameter (its TP marks, its shape)
    shape: tuple                   # its (TP-local) shape
    offset: int                    # contiguous: where it starts in the group's whole flat buffer;
                                   # per_param: where its partition starts in this rank's partition
    numel: int
    part: int = 0                  # per_param: the partition size of this parameter


class FlatLayout:
    """The matrices of one flat partition (``kind``: ``contiguous`` or ``per_param``)."""

    def __init__(self, kind: str, pieces: list[Piece], group, size: int):
        self.kind, self.pieces, self.group, self.size = kind, pieces, group, size
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def touching(self) -> list[Piece]:
        """The matrices with elements in this rank's partition, in the order ``orthogonalize`` visits them."""
        if self.kind != "contiguous":
            return list(self.pieces)
        lo_mine, hi_mine = self.rank * self.size, (self.rank + 1) * self.size
        return [p for p in self.pieces if max(p.offset, lo_mine) < min(p.offset + p.numel, hi_mine)]

    def orthogonalize(self, u: torch.Tensor, fn) -> torch.Tensor:
        """This rank's part of the orthogonalised update, from its part ``u`` of the Nesterov update;
        ``fn(whole_matrix, param, k)`` orthogonalises one matrix, the k-th of ``touching()``."""
        gathered = [torch.empty_like(u) for _ in range(self.world)]
        dist.all_gather(gathered, u.contiguous(), group=self.group)
        out = torch.zeros_like(u)
        if self.kind == "contiguous":
            flat = torch.cat(gathered)
            lo_mine = self.rank * self.size
            for k, piece in enumerate(self.touching()):
                lo, hi = piece.offset, piece.offset + piece.numel
                a, b = max(lo, lo_mine), min(hi, lo_mine + self.size)
                whole = fn(flat[lo:hi].view(piece.shape), piece.param, k).reshape(-1)
                out[a - lo_mine:b - lo_mine] = whole[a - lo:b - lo]
        else:
            rows = torch.stack(gathered)                      # [world, size]
            for k, piece in enumerate(self.pieces):
                span = slice(piece.offset, piece.offset + piece.part)
                whole = rows[:, span].reshape(-1)[:piece.numel].view(piece.shape)
                done = F.pad(fn(whole, piece.param, k).reshape(-1), (0, piece.part * self.world - piece.numel))
                out[span] = done.view(self.world, piece.part)[self.rank]
        return out

    def fill(self, value) -> torch.Tensor:
        """This rank's partition with each element set to ``value(piece)`` of the matrix it belongs to
        (0 in the padding): a per-element factor, no communication."""
        out = torch.zeros(self.size)
        for piece in self.pieces:
            if self.kind == "contiguous":
                lo, hi = piece.offset, piece.offset + piece.numel
                a, b = max(lo, self.rank * self.size), min(hi, (self.rank + 1) * self.size)
                if a < b:
                    out[a - self.rank * self.size:b - self.rank * self.size] = value(piece)
            else:
                start = min(self.rank * piece.part, piece.numel)
                mine = min(piece.part, piece.numel - start)
                out[piece.offset:piece.offset + mine] = value(piece)
        return out


def attach(ds_optimizer, optimizer) -> int:
    """Give ``optimizer`` (MuonAdamW) the layout of every flat partition DeepSpeed's ``ds_optimizer``
    steps it on for its Muon groups; returns how many. An optimizer DeepSpeed steps on the
    parameters themselves (ZeRO-0 in fp32) needs none. Raises NotImplementedError for another wrapper."""
    name = type(ds_optimizer).__name__
    groups = optimizer.param_groups
    muon = [i for i, g in enumerate(groups) if g["kind"] == "muon"]
    if ds_optimizer is optimizer or not muon:
        return 0
    if name == "DeepSpeedZeroOptimizer":
        flats, params, parts = ds_optimizer.bit16_groups_flat, ds_optimizer.bit16_groups, \
            ds_optimizer.single_partition_of_fp32_groups
    elif name == "BF16_Optimizer":
        flats, params, parts = ds_optimizer.bf16_groups_flat, ds_optimizer.bf16_groups, \
            ds_optimizer.fp32_groups_flat_partition
    elif name == "DeepSpeedZeroOptimizer_Stage3":
        return _attach_stage3(ds_optimizer, optimizer)
    elif name == "FP16_UnfusedOptimizer":
        # bf16 without ZeRO: whole fp32 copies of each parameter (runtime/fp16/unfused_optimizer.py
        # ``p.clone().float().detach()``), which carry none of the TP marks the gather reads
        for i in muon:
            for low, high in zip(ds_optimizer.fp16_groups[i], ds_optimizer.fp32_groups[i]):
                for mark in ("tensor_model_parallel", "partition_dim", "tp_parts", "fused"):
                    if hasattr(low, mark):
                        setattr(high, mark, getattr(low, mark))
        return len(muon)
    else:
        raise NotImplementedError(f"train.optimizer: muon_adamw does not know DeepSpeed's {name}")
    for i in muon:
        flat = flats[i]
        pieces = [Piece(p, tuple(p.shape), (p.data_ptr() - flat.data_ptr()) // flat.element_size(), p.numel())
                  for p in params[i]]
        optimizer.layouts[id(parts[i])] = FlatLayout("contiguous", pieces, ds_optimizer.real_dp_process_group[i],
                                                     parts[i].numel())
    return len(muon)


def _attach_stage3(ds_optimizer, optimizer) -> int:
    count = 0
    for k, sub_group in enumerate(ds_optimizer.fp16_groups):
        if optimizer.param_groups[ds_optimizer.sub_group_to_group_id[k]]["kind"] != "muon":
            continue
        pieces, offset = [], 0
        for p in sub_group:
            part = p.partition_numel()
            pieces.append(Piece(p, tuple(p.ds_shape), offset, p.ds_numel, part))
            offset += part
        flat = ds_optimizer.fp32_partitioned_groups_flat[k]
        optimizer.layouts[id(flat)] = FlatLayout("per_param", pieces, ds_optimizer.sub_group_process_groups[k],
                                                 flat.numel())
        count += 1
    return count
