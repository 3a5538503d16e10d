"""Resuming a run, in one place: which checkpoint, whether it fits this run, how it loads (the
same layout from DeepSpeed's own shards or fpscale's one-process files; another layout through
DeepSpeed's universal checkpoint) and where the data and random streams continue.

Two calls, because DeepSpeed must know before it is initialised whether it loads a universal
checkpoint:

    plan = plan_resume(cfg, state, run_dir, model, progress)       # every rank, before deepspeed.initialize
    engine = deepspeed.initialize(..., config={"checkpoint": {"load_universal": plan.universal}})
    resume(plan, cfg, state, model, optimizer, engine, progress)

The same layout continues exactly (optimizer, random streams, sample stream). Another layout
continues the optimizer and the sample stream (from the global sample count); its ranks saved no
streams of their own, so the streams restart from ``seed + step``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from fpscale.config import Config
from fpscale.log import get_logger
from fpscale.train import checkpoint
from fpscale.train.checkpoint import CheckpointError
from fpscale.train.state import COUNTERS, TrainState

log = get_logger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run continues from: its folder, its meta.json, and whether it loads
    through a universal checkpoint (saved on another layout; already converted)."""
    folder: str
    meta: dict
    universal: bool


def plan_resume(cfg: Config, state, run_dir: str, model, progress: TrainState) -> ResumePlan | None:
    """Choose the checkpoint (``train.resume``), refuse one that does not fit, and on another
    layout have rank 0 convert it to a universal checkpoint. Every rank calls it; None: start fresh."""
    folder = choose_checkpoint(cfg.train.resume, run_dir, state)
    if folder is None:
        return None
    meta = checkpoint.read_meta(folder)
    check_compatible(meta, model, state.tp_size, progress.batches.state().fingerprint, cfg.train.global_batch)
    if same_layout(meta, state, cfg.parallel.zero_stage):
        return ResumePlan(folder, meta, universal=False)
    where = saved_on(meta)
    if not state.deepspeed or meta["kind"] != "deepspeed" or meta["zero_stage"] == 0:
        raise CheckpointError(
            f"{folder} was saved on {where}; it resumes on another layout only from a DeepSpeed "
            f"ZeRO 1-3 checkpoint into a DeepSpeed run (its weights load anywhere: launch/convert.py)")
    if cfg.train.optimizer == "muon_adamw" and cfg.train.muon.normuon:
        raise CheckpointError(f"{folder} was saved on {where}: train.muon.normuon keeps its moments per whole matrix "
                              f"(state normuon_v), which DeepSpeed's universal checkpoint does not carry; resume it "
                              f"on the layout it was saved on (docs/optimizers.md)")
    log.info("resuming %s (saved on %s) through a universal checkpoint", folder, where)
    checkpoint.prepare_universal(folder, state)
    return ResumePlan(folder, meta, universal=True)


def resume(plan: ResumePlan, cfg: Config, state, model, optimizer, engine, progress: TrainState) -> None:
    """Load ``plan``'s weights and optimizer (through ``engine`` when DeepSpeed runs, else into
    ``model`` and ``optimizer``), then continue ``progress`` from the checkpoint."""
    tag = os.path.basename(plan.folder)
    if engine is not None:
        root = os.path.dirname(plan.folder)
        load_dir = os.path.join(root, "universal") if plan.universal else root
        path, _ = engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag} in {load_dir}")
    else:
        model.load_state_dict(_load(plan.folder, "model.pt", state.device))
        optimizer.load_state_dict(_load(plan.folder, "optim.pt", state.device))
    counters = {key: plan.meta[key] for key in COUNTERS}
    if plan.universal:        # other ranks, other streams: restart them; buffers merged and re-split
        progress.load_state_dict(counters)
        progress.reseed(cfg.seed, state)
        checkpoint.load_buffers(model, checkpoint.whole_buffers(plan.folder, plan.meta), state)
    else:
        mine = _load(plan.folder, checkpoint.rank_file(state.rank), torch.device("cpu"))
        progress.load_state_dict({**counters, "rng": mine["rng"]})
    log.info("resumed from %s at step %d (%d samples consumed)", plan.folder, progress.step,
             progress.consumed_samples)


def _load(folder: str, name: str, device: torch.device):
    return torch.load(os.path.join(folder, name), map_location=device, weights_only=True)


def choose_checkpoint(resume: str, run_dir: str, state) -> str | None:
    """The checkpoint folder ``train.resume`` names (``auto``: the newest complete one of the run;
    ``none``; or a path, which must pass its manifest), decided on rank 0, the same on every rank."""
    if resume == "none":
        return None
    if resume == "auto":
        return checkpoint.newest_complete(os.path.join(run_dir, checkpoint.CHECKPOINTS), state)
    problem = checkpoint.verify_together(resume, state)
    if problem:
        raise CheckpointError(f"train.resume = {resume}: {problem}")
    return resume


def same_layout(meta: dict, state, zero_stage: int) -> bool:
    """Whether ``meta`` was saved on this run's layout: its own shards load as they are."""
    kind = "deepspeed" if state.deepspeed else "single"
    return (meta["kind"] == kind and meta["tp"] == state.tp_size and meta["dp"] == state.dp_size
            and (not state.deepspeed or meta["zero_stage"] == zero_stage))


def saved_on(meta: dict) -> str:
    zero = meta["zero_stage"]
    return f"tp {meta['tp']} x dp {meta['dp']}, " + (f"ZeRO-{zero}" if zero is not None else "one process")


def check_compatible(meta: dict, model, tp: int, data_fingerprint: str, global_batch: int) -> None:
    """Refuse a checkpoint of another model shape, other data or another global batch (the
    sample stream would not continue), naming what differs. ``model`` is this rank's (TP-split)
    model, ``tp`` this run's tensor-parallel size."""
    shapes = checkpoint.whole_shapes(model, tp)
    want = checkpoint.fingerprint(shapes)
    if meta["model_fingerprint"] != want:
        saved = meta["shapes"]
        differ = [f"{name}: {saved.get(name)} saved, {shapes.get(name)} here"
                  for name in sorted(set(saved) | set(shapes)) if saved.get(name) != shapes.get(name)]
        raise CheckpointError(f"the checkpoint's model has other tensor shapes ({'; '.join(differ[:3])}; "
                              f"fingerprint {meta['model_fingerprint']} vs {want}): its model section is "
                              f"{json.dumps(meta['config']['model'])[:400]}")
    if meta["data_fingerprint"] != data_fingerprint:
        raise CheckpointError(f"the checkpoint was trained on other data (fingerprint {meta['data_fingerprint']}, "
                              f"this run's {data_fingerprint}): its data section is {meta['config']['data']}")
    saved_batch = meta["config"]["train"]["global_batch"]
    if saved_batch != global_batch:
        raise CheckpointError(f"train.global_batch = {global_batch} differs from the checkpoint's {saved_batch}: "
                              "the sample stream would not continue")
