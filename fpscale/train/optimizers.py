"""The optimizer of a run, built from ``train``: parameter groups by role, each with its learning rate,
weight decay and betas; torch's AdamW for ``train.optimizer: adamw``, fpscale's MuonAdamW
(fpscale/train/muon.py) for ``muon_adamw``. One function the trainer calls (``build_optimizer``),
one it calls every step (``apply_schedule``), and one after ``deepspeed.initialize`` (``attach_layout``).

Roles (``role``), by the parameter's place and shape:
  embed    the token embedding (also the tied output layer)           AdamW, no decay
  head     an untied output layer (``lm_head``)                       AdamW, decay
  norm     norm weights, also the looped core's stacked ones (2-D)    AdamW, no decay
  scalar   other 1-D parameters: biases, gains, scalars (a1, log_temp) AdamW, no decay
  other    >= 2-D block weights that are no linear map: tables marked ``_no_weight_decay`` (FP-Mamba's
           A_log), depthwise convolution filters, epsilon's prototypes, fpsa_lh's per-head halting
           vectors (``NOT_A_MATRIX``)                                  AdamW, decay unless marked
  muon     every other >= 2-D weight of ``model.layers``: attention and MLP projections, mixers' and
           looped cores' matrices (stacked ones: a batch of matrices)  Muon (muon_adamw)
  matrix   the same weights under ``optimizer: adamw``, or moved to AdamW by ``group_override``
Muon follows Keller Jordan's rule (muon.py: "Muon should only be used for hidden weight layers. The
input embedding, final output layer, and any internal gains or biases should be optimized using a
standard method such as AdamW"). ``train.group_override: {layers.3: matrix}`` moves every parameter
whose name starts with a prefix to a group (Attractor keeps its whole fixed-point head in AdamW:
attractor/models/attractor/attractor.py tags ``core_block`` ``_fp_head``).

Groups of the same settings are merged (``norm+scalar``): DeepSpeed flattens and partitions each group
on its own, and a group of a few scalars, all of it padding on some rank, breaks DeepSpeed 0.19.8's
universal-checkpoint load (runtime/base_optimizer.py ``steps[0]``: IndexError) where that rank owns
none of it. Give such a group its own lr only where no universal resume is needed.

``optimizer: adamw`` without any per-group key keeps fpscale's two groups (decay / no decay), so
its checkpoints and layouts are those of earlier runs.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch

from fpscale.errors import ConfigError
from fpscale.train.muon import MuonAdamW
from fpscale.train.optim import AdamW
from fpscale.train.optim_config import GROUPS
from fpscale.train.schedule import lr_at, momentum_at

NOT_A_MATRIX = {
    "conv_w": "depthwise convolution filters, one per channel (fpmamba)",
    "prototypes": "a table of prototypes per head (epsilon)",
    "gate_w2": "one halting vector per head, not a map between spaces (fpsa_lh)",
}


def decayed_by_default(name: str, p: torch.Tensor) -> bool:
    """fpscale's weight-decay rule: matrices yes; 1-D parameters, embeddings, norms (by name: the
    looped core stacks its norm weights, 2-D yet no matrix) and what a layer marks ``_no_weight_decay``
    (mamba_ssm's convention: FP-Mamba's A_log) no."""
    return not (p.dim() < 2 or "embed" in name or "norm" in name or getattr(p, "_no_weight_decay", False))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The two groups of ``optimizer: adamw`` without per-group keys: decayed, not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decayed_by_default(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def role(name: str, p: torch.Tensor, muon: bool) -> str:
    """The group of parameter ``name`` by its role (module docstring)."""
    last = name.split(".")[-1]
    if name.startswith("embed."):
        return "embed"
    if name == "lm_head":
        return "head"
    if "norm" in name:
        return "norm"
    if p.dim() < 2:
        return "scalar"
    if not name.startswith("layers.") or getattr(p, "_no_weight_decay", False) or last in NOT_A_MATRIX:
        return "other"
    return "muon" if muon else "matrix"


def assign(model: torch.nn.Module, t) -> dict[str, str]:
    """{parameter name: group} for TrainConfig ``t``, with ``t.group_override`` applied."""
    muon = t.optimizer == "muon_adamw"
    out = {name: role(name, p, muon) for name, p in model.named_parameters() if p.requires_grad}
    shapes = dict(model.named_parameters())
    for prefix, group in t.group_override.items():
        key = f"train.group_override.{prefix}"
        hits = [n for n in out if n == prefix or n.startswith(prefix + ".")]
        if not hits:
            raise ConfigError(key, f"names no parameter (a prefix of parameter names, e.g. layers.3 or "
                                   f"layers.0.attn.w_qkv; the model has {', '.join(list(out)[:4])}, ...)")
        for n in hits:
            if group == "muon" and shapes[n].dim() < 2:
                raise ConfigError(key, f"puts {n} (shape {tuple(shapes[n].shape)}) in muon: Muon needs a matrix")
            out[n] = group
    return out


def build_optimizer(model: torch.nn.Module, cfg, tp_group=None) -> tuple[torch.optim.Optimizer, list[str]]:
    """(the optimizer, the lines describing its groups) for ``cfg.train``; ``tp_group``: the
    tensor-parallel group Muon gathers matrices over. Every group carries ``lr_scale`` (the trainer
    sets lr = scheduled lr x lr_scale each step)."""
    t = cfg.train
    plain = t.optimizer == "adamw" and not (t.lr_scale or t.group_weight_decay or t.group_betas or t.group_override)
    if plain:
        groups = param_groups(model, t.weight_decay)
        for g in groups:
            g["lr_scale"], g["group"] = 1.0, "decay" if g["weight_decay"] else "no_decay"
        groups = [g for g in groups if g["params"]]
        names = {id(p): n for n, p in model.named_parameters()}
        lines = describe(groups, names)
        return AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps), lines
    mark_fused(model)
    where = assign(model, t)
    buckets: dict[tuple[str, bool], list] = defaultdict(list)
    names = {}
    for name, p in model.named_parameters():
        if name in where:
            buckets[(where[name], decayed_by_default(name, p))].append(p)
            names[id(p)] = name
    m = t.muon
    groups = []
    for group in GROUPS:
        for decayed in (True, False):
            params = buckets.get((group, decayed))
            if not params:
                continue
            base_wd = (m.weight_decay if m.weight_decay is not None else t.weight_decay) if group == "muon" \
                else t.weight_decay
            wd = t.group_weight_decay.get(group, base_wd if decayed else 0.0)
            g = {"params": params, "group": group, "lr": t.lr, "lr_scale": t.lr_scale.get(group, 1.0),
                 "weight_decay": wd}
            if group == "muon":
                g.update(kind="muon", momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                         ns_dtype=m.ns_dtype, ns_coefficients=m.ns_coefficients, shape_scale=m.shape_scale,
                         cautious=m.cautious_wd, normuon=m.normuon, normuon_beta2=m.normuon_beta2,
                         wd_scale=m.wd_scale, split_fused=m.split_fused, base_weight_decay=wd)
            else:
                g.update(kind="adamw", betas=tuple(t.group_betas.get(group, (t.beta1, t.beta2))), eps=t.eps)
            same = next((h for h in groups if {k: v for k, v in h.items() if k not in ("params", "group")}
                         == {k: v for k, v in g.items() if k not in ("params", "group")}), None)
            if same is None:
                groups.append(g)
            else:        # one group per setting: DeepSpeed flattens and partitions each group on its own
                same["params"] += params
                same["group"] += "" if group in same["group"].split("+") else f"+{group}"
    if t.optimizer == "adamw":
        for g in groups:
            del g["kind"], g["eps"]
        optimizer = AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    else:
        optimizer = MuonAdamW(groups, tp_group=tp_group)
    return optimizer, describe(groups, names)


def mark_fused(model: torch.nn.Module) -> None:
    """Mark each fused projection (a weight a layer's ``tp_plan`` declares as ``parts`` > 1 equal sub-tensors:
    q/k/v in ``w_qkv``) ``fused = (dim, parts)``: Muon's ``split_fused`` orthogonalises it part by part."""
    for module in model.modules():
        if hasattr(module, "tp_plan"):
            for name, how in module.tp_plan().items():
                p = getattr(module, name, None)
                if isinstance(p, torch.nn.Parameter) and how.parts > 1:
                    p.fused = (how.dim, how.parts)


def describe(groups: list[dict], names: dict[int, str]) -> list[str]:
    """One line per group (optimizer, tensors, elements, lr scale, weight decay) and the parameters in
    it, the layer index folded: ``layers.{0-11}.attn.w_qkv``."""
    lines = ["parameter groups:"]
    for g in groups:
        kind = g.get("kind", "adamw")
        count = sum(p.numel() for p in g["params"])
        lines.append(f"  {g['group']:<8} {kind:<5} {len(g['params']):>4} tensors {count:>12,} params  "
                     f"lr x {g['lr_scale']:g}  wd {g['weight_decay']:g}")
        folded: dict[str, list[int]] = defaultdict(list)
        for p in g["params"]:
            match = re.match(r"layers\.(\d+)\.(.*)", names[id(p)])
            key = f"layers.{{}}.{match.group(2)}" if match else names[id(p)]
            folded[key].append(int(match.group(1)) if match else -1)
        parts = []
        for pattern, idx in folded.items():
            if "{}" not in pattern:
                parts.append(pattern)
                continue
            span = str(idx[0]) if len(idx) == 1 else f"{idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) \
                else ",".join(map(str, idx))
            parts.append(pattern.format(span if len(idx) == 1 else "{" + span + "}"))
        lines.append("           " + ", ".join(parts))
    return lines


def apply_schedule(param_groups: list[dict], step: int, t) -> float:
    """Set every group's lr (the schedule's x its ``lr_scale``), Muon's momentum and (``wd_schedule:
    linear``) Muon's weight decay for ``step``; returns the scheduled lr."""
    lr = lr_at(step, t.lr, t.min_lr, t.warmup, t.steps, t.schedule, t.decay_fraction, t.decay_shape)
    momentum = momentum_at(step, t.muon.momentum, t.muon.momentum_start, t.muon.momentum_warmup)
    wd_factor = max(0.0, 1 - step / t.steps) if t.muon.wd_schedule == "linear" else 1.0
    for g in param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
        if g.get("kind") == "muon":
            g["momentum"] = momentum
            g["weight_decay"] = g["base_weight_decay"] * wd_factor
    return lr


def attach_layout(ds_optimizer, optimizer) -> None:
    """After ``deepspeed.initialize``: tell MuonAdamW where its matrices lie in the flat partitions
    DeepSpeed steps it on (fpscale/train/muon_zero.py); nothing for AdamW."""
    if isinstance(optimizer, MuonAdamW):
        from fpscale.train import muon_zero
        muon_zero.attach(ds_optimizer, optimizer)
