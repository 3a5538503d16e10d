"""Saving a checkpoint: every rank writes its share into ``.partial/``, hashes it, rank 0 writes the
manifest last and publishes the folder by a rename; a full disk or a failure on any rank fails the
save on every rank together and leaves the last complete checkpoint as it was; old ones rotate."""
from __future__ import annotations

import errno
import json
import os
import shutil

import torch
import torch.distributed as dist

from fpscale.config import Config, config_to_dict
from fpscale.errors import StorageFull
from fpscale.files import fsync_dir, write_atomic
from fpscale.log import get_logger
from fpscale.train import faults
from fpscale.train.checkpoint.format import (
    CHECKPOINTS,
    barrier,
    fingerprint,
    hash_share,
    list_files,
    published,
    rank_file,
    split_info,
    tag_for,
    universal_info,
    whole_shapes,
    write_manifest,
)
from fpscale.train.state import TrainState

log = get_logger(__name__)


def save_timeout_s(parallel, num_params: int) -> float:
    """How long the ranks of a save may wait for each other: ``parallel.save_timeout_s`` if set,
    else the collective timeout plus the slowest rank's writing and hashing of a checkpoint of
    16 bytes per parameter (fp32 weights, master copy and two Adam moments) at a pessimistic
    100 MB/s of a shared file system."""
    if parallel.save_timeout_s > 0:
        return parallel.save_timeout_s
    seconds_to_write, seconds_to_hash = 16 * num_params / 100e6, 16 * num_params / 100e6
    return parallel.timeout_s + seconds_to_write + seconds_to_hash



def save(run_dir: str, cfg: Config, state, model, optimizer, engine, progress: TrainState) -> str:
    """Write a checkpoint of ``progress.step`` under ``run_dir/checkpoints``; every rank calls it.
    ``engine`` is the DeepSpeed engine (None on one process, which saves ``model`` and
    ``optimizer`` itself). Returns the published folder.

    A write that runs out of space on any rank (full disk, quota, file-size limit) ends the save
    on every rank with ``StorageFull``: the partial folder is removed, nothing is published, and
    the message names the newest published checkpoint, which was never touched."""
    root = os.path.join(run_dir, CHECKPOINTS)
    tag = tag_for(progress.step)
    partial = os.path.join(root, ".partial")
    work = os.path.join(partial, tag)
    faults.at("save", progress.step)
    if state.is_main:
        shutil.rmtree(work, ignore_errors=True)          # left by a save that was killed
        shutil.rmtree(os.path.join(partial, "discarded"), ignore_errors=True)
        os.makedirs(work)
    barrier(state)
    materialize_adam_state(optimizer)
    failure, in_engine = None, False
    try:
        if engine is not None:
            in_engine = True
            engine.save_checkpoint(partial, tag=tag, save_latest=False, client_state={
                "universal_checkpoint_info": universal_info(model, state.tp_size)})
            in_engine = False
        else:
            torch.save(model.state_dict(), os.path.join(work, "model.pt"))
            torch.save(optimizer.state_dict(), os.path.join(work, "optim.pt"))
        torch.save(rank_state(model, progress, state), os.path.join(work, rank_file(state.rank)))
        if state.is_main:
            meta = describe(cfg, state, model, engine is not None, progress)
            write_atomic(os.path.join(work, "meta.json"), json.dumps(meta, indent=1))
    except Exception as exc:                   # torch.save reports a full disk as a RuntimeError
        failure = storage_failure(work, exc, state.rank)
        if in_engine and state.distributed:
            # DeepSpeed ends its save with a barrier of every rank, where the ranks whose writes
            # succeeded now wait: join it, so that every rank reaches the agreement below
            dist.barrier()
    fail_together(state, failure, root, tag)
    faults.at("hash", progress.step)
    listing = [list_files(work) if state.is_main else None]
    if state.distributed:
        dist.broadcast_object_list(listing, src=0, group=state.host_group)
    share = hash_share(work, state.rank, state.world_size, listing[0])    # every rank hashes about 1/world
    shares = [share]
    if state.distributed:
        shares = [None] * state.world_size if state.is_main else None
        dist.gather_object(share, shares, dst=0, group=state.host_group)
    target = os.path.join(root, tag)
    if state.is_main:
        try:
            write_manifest(work, shares)                              # last: marks the folder complete
        except Exception as exc:
            failure = storage_failure(work, exc, state.rank)
        if failure is None:
            discard(target, root)                # a checkpoint of this step saved before (a re-run)
            os.replace(work, target)
            fsync_dir(root)
            rotate(root, cfg.train.keep_last)
            log.info("saved checkpoint %s", target)
    fail_together(state, failure, root, tag)
    return target


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def storage_failure(folder: str, exc: Exception, rank: int) -> str:
    """What to report when a write into ``folder`` raised ``exc``, if the cause is that the file
    system takes no more (full, over quota, over the file-size limit); otherwise ``exc`` is
    raised again (a bug keeps its traceback). torch.save reports a full disk as a RuntimeError
    without errno, so the file system is asked directly: a 1 MiB probe write."""
    cause = exc if isinstance(exc, OSError) and exc.errno in NO_SPACE else None
    if cause is None:
        probe = os.path.join(folder, f".space_probe.{os.getpid()}")
        try:
            with open(probe, "wb") as fh:
                fh.write(bytes(1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as refused:
            if refused.errno not in NO_SPACE:
                raise exc from None
            cause = refused
        finally:
            if os.path.exists(probe):
                os.unlink(probe)
        if cause is None:
            raise exc
    return f"rank {rank}: {os.strerror(cause.errno)} ({type(exc).__name__}: {str(exc)[:200]})"


def fail_together(state, failure: str | None, root: str, tag: str) -> None:
    """Every rank learns whether any rank's part of the save failed (one gather on the host
    group, which also serves as the save's barrier); if one did, the partial folder goes and
    every rank raises ``StorageFull`` naming the newest published checkpoint."""
    failures = [failure]
    if state.distributed:
        failures = [None] * state.world_size
        dist.all_gather_object(failures, failure, group=state.host_group)
    failed = [f for f in failures if f]
    if not failed:
        return
    if state.is_main:
        shutil.rmtree(os.path.join(root, ".partial", tag), ignore_errors=True)
    barrier(state)
    last = published(root)
    kept = (f"the last complete checkpoint {last[0]} is intact (resume: auto continues from it)" if last else
            "no earlier checkpoint exists")
    raise StorageFull(f"checkpoint {tag} could not be written, the file system takes no more data "
                      f"({'; '.join(failed)}); its partial files were removed and nothing was published; {kept}. "
                      f"Free space under {root}, then run the same command again")


def describe(cfg: Config, state, model, deepspeed: bool, progress: TrainState) -> dict:
    """meta.json: the counters, the layout saved on, what the model and data are (fingerprints,
    whole shapes, TP split) and the resolved config."""
    shapes = whole_shapes(model, state.tp_size)
    return {**progress.counters(), "kind": "deepspeed" if deepspeed else "single",
            "tp": state.tp_size, "dp": state.dp_size, "world": state.world_size,
            "zero_stage": cfg.parallel.zero_stage if deepspeed else None,
            "model_fingerprint": fingerprint(shapes), "data_fingerprint": progress.batches.state().fingerprint,
            "split": split_info(model), "shapes": shapes, "config": config_to_dict(cfg)}


def materialize_adam_state(optimizer) -> None:
    """Create AdamW's state where no step has created it yet (a step-0 checkpoint), exactly as
    AdamW's first step would: DeepSpeed's universal converter needs every moment to exist."""
    from torch.optim.optimizer import _get_scalar_dtype
    inner = getattr(optimizer, "optimizer", optimizer)      # DeepSpeed's ZeRO wrappers hold the torch one
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def rotate(root: str, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for folder in published(root)[keep_last:]:
        discard(folder, root)
        discard(os.path.join(root, "universal", os.path.basename(folder)), root)


def discard(folder: str, root: str) -> None:
    """Delete ``folder`` (under checkpoint ``root``) so that a kill part-way never leaves a
    half-deleted checkpoint in sight: one atomic rename into ``root/.partial/discarded`` first,
    whose leftovers the next save clears."""
    if not os.path.exists(folder):
        return
    trash = os.path.join(root, ".partial", "discarded")
    os.makedirs(trash, exist_ok=True)
    moved = os.path.join(trash, f"{os.path.basename(folder)}.{os.getpid()}")
    os.replace(folder, moved)
    shutil.rmtree(moved, ignore_errors=True)
    try:
        os.rmdir(trash)
    except OSError:
        pass


def rank_state(model, progress: TrainState, state) -> dict:
    """This rank's file: where it sits in the layout, its random streams and the model's buffers
    (e.g. power-iteration vectors, which no optimizer holds)."""
    sd = progress.state_dict()
    return {"step": sd["step"], "rank": state.rank, "tp_rank": state.tp_rank, "dp_rank": state.dp_rank,
            "rng": sd["rng"], "buffers": {n: b.detach().cpu() for n, b in model.named_buffers()}}

