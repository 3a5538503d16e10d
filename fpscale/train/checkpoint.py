"""Sharded checkpoints: save, verify, find, convert to a universal checkpoint, load whole weights.

    runs/<name>/checkpoints/
        step_00000008/                 one complete checkpoint, published by a rename
            mp_rank_*_model_states.pt, *_optim_states.pt    DeepSpeed's shards (several processes)
            model.pt, optim.pt         the same for one process
            fpscale_rank00000.pt       per rank: step, its place in the layout, RNG streams, buffers
            meta.json                  step, layout, fingerprints, resolved config, TP split metadata
            manifest.json              size and sha256 of every file above (and which rank hashed
                                       how many bytes); written last
        .partial/step_.../             a save in progress: never read, cleared by the next save
        universal/step_.../            DeepSpeed's universal checkpoint, made once on a layout change

A checkpoint is complete when its manifest exists and every file matches it. ``resume: auto``
takes the newest complete one; a damaged one is skipped with a warning naming the file.
Hashing is shared: the files are dealt to the ranks by size (``deal``), each rank hashes its
share on save and on resume, so no rank reads more than about 1/world of a checkpoint; the
coordination of a save runs on a gloo group whose timeout grows with the bytes saved
(``save_timeout_s``), beside the compute group's ``parallel.timeout_s``.
Resuming a run from one is fpscale/train/resume.py; ``whole_weights`` (and ``load_model`` on it)
reads the whole weights of a checkpoint of any layout, for evaluation, export and
``train.init_weights``. Everything fpscale writes loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist

from fpscale.config import Config, config_to_dict
from fpscale.errors import CheckpointError, StorageFull
from fpscale.files import fsync_dir, sha256_file, write_atomic
from fpscale.log import get_logger
from fpscale.models import build_model
from fpscale.parallel.layers import shard, unshard
from fpscale.train import faults
from fpscale.train.state import TrainState
from fpscale.typed import from_dict

log = get_logger(__name__)

CHECKPOINTS = "checkpoints"
TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"fpscale_rank{rank:05d}.pt"


# -- what describes the model independently of the layout --------------------------------------
def split_info(model) -> dict[str, tuple[int, int]]:
    """{name: (partition_dim, parts)} of every TP-split parameter and buffer."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return {n: (t.partition_dim, getattr(t, "tp_parts", 1)) for n, t in tensors
            if getattr(t, "tensor_model_parallel", False)}


def whole_shapes(model, tp: int) -> dict[str, list[int]]:
    """Shapes of the unsplit tensors (parameters and buffers), from one TP rank's model."""
    split = split_info(model)
    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        shape = list(getattr(t, "ds_shape", t.shape))
        if n in split:
            shape[split[n][0]] *= tp
        out[n] = shape
    return out


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def universal_info(model, tp: int) -> dict:
    """DeepSpeed's universal-checkpoint metadata: how to merge and re-split every parameter."""
    from deepspeed.checkpoint import constants as C
    split = split_info(model)
    shapes = whole_shapes(model, tp)
    replicated, sub_params, widths = [], [], {}
    for name, _ in model.named_parameters():
        pattern = f"^{re.escape(name)}$"
        if name not in split:
            replicated.append(pattern)
            continue
        dim, parts = split[name]
        shape = list(shapes[name])
        size = shape[dim] // parts
        shape[dim] = (size,) * parts
        sub_params.append({"patterns": [pattern], "shape": tuple(shape), "partition_dim": dim})
        widths[pattern] = [[size // tp] * tp for _ in range(parts)]
    return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            C.TP_REPLICATED_PARAMETER_PATTERNS: replicated, C.PARAMETER_WITH_SUB_PARAMS: sub_params,
            C.SUB_PARAM_SHARD_WIDTHS: widths}


# -- manifest ------------------------------------------------------------------------------------
def deal(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files of a checkpoint dealt to ``world`` ranks for hashing: largest first, each to the
    rank with the fewest bytes so far (the same answer on every rank: sorted, ties by name)."""
    shares, load = [[] for _ in range(world)], [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(name)
        load[r] += sizes[name]
    return shares


def _files(folder: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            rel = os.path.relpath(path, folder)
            if rel != "manifest.json":
                out[rel] = os.path.getsize(path)
    return out


def hash_share(folder: str, rank: int = 0, world: int = 1, sizes: dict[str, int] | None = None) -> dict[str, dict]:
    """{file: {bytes, sha256}} of this rank's share of ``folder``'s files (``sizes``: rank 0's
    listing, so that every rank deals the same files even where a file system lists late)."""
    sizes = sizes if sizes is not None else _files(folder)
    return {rel: {"bytes": sizes[rel], "sha256": sha256_file(os.path.join(folder, rel))}
            for rel in deal(sizes, world)[rank]}


def write_manifest(folder: str, shares: list[dict[str, dict]] | None = None) -> None:
    """The manifest from every rank's ``hash_share`` (one process: hashes everything itself)."""
    shares = shares if shares is not None else [hash_share(folder)]
    files = {rel: entry for share in shares for rel, entry in sorted(share.items())}
    hashed = {str(r): sum(e["bytes"] for e in share.values()) for r, share in enumerate(shares)}
    write_atomic(os.path.join(folder, "manifest.json"),
                  json.dumps({"files": dict(sorted(files.items())), "hashed_bytes_by_rank": hashed}, indent=1))


def verify(folder: str, rank: int = 0, world: int = 1) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong (naming the file). With
    ``world`` > 1, only this rank's share of the files is hashed (``verify_together``)."""
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    path = os.path.join(folder, "manifest.json")
    if not os.path.exists(path):
        return f"{path} is missing (an interrupted save)"
    try:
        files = json.load(open(path))["files"]
    except (ValueError, KeyError) as exc:
        return f"{path} is unreadable ({exc})"
    for rel, want in files.items():
        f = os.path.join(folder, rel)
        if not os.path.exists(f):
            return f"{f} is missing"
        if os.path.getsize(f) != want["bytes"]:
            return f"{f} has {os.path.getsize(f)} bytes, the manifest says {want['bytes']}"
    for rel in deal({rel: want["bytes"] for rel, want in files.items()}, world)[rank]:
        if sha256_file(os.path.join(folder, rel)) != files[rel]["sha256"]:
            return f"{os.path.join(folder, rel)} fails its sha256 checksum"
    return None


def verify_together(folder: str, state) -> str | None:
    """``verify`` with the hashing shared by every rank of ``state``; the same answer on each."""
    if not state.distributed:
        return verify(folder)
    problems = [None] * state.world_size
    dist.all_gather_object(problems, verify(folder, state.rank, state.world_size), group=state.host_group)
    return next((p for p in problems if p), None)


def save_timeout_s(parallel, num_params: int) -> float:
    """How long the ranks of a save may wait for each other: ``parallel.save_timeout_s`` if set,
    else the collective timeout plus the slowest rank's writing and hashing of a checkpoint of
    16 bytes per parameter (fp32 weights, master copy and two Adam moments) at a pessimistic
    100 MB/s of a shared file system."""
    if parallel.save_timeout_s > 0:
        return parallel.save_timeout_s
    seconds_to_write, seconds_to_hash = 16 * num_params / 100e6, 16 * num_params / 100e6
    return parallel.timeout_s + seconds_to_write + seconds_to_hash


def published(root: str) -> list[str]:
    """Published checkpoint folders under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    tags = sorted((t for t in os.listdir(root) if TAG.match(t)), reverse=True)
    return [os.path.join(root, t) for t in tags]


def newest_complete(root: str, state=None) -> str | None:
    """The newest checkpoint that passes its manifest; damaged ones are skipped with a warning.
    With ``state``, every rank calls it and shares the hashing (the listing is rank 0's)."""
    folders = published(root)
    if state is not None and state.distributed:
        box = [folders]
        dist.broadcast_object_list(box, src=0, group=state.host_group)
        folders = box[0]
    for folder in folders:
        problem = verify_together(folder, state) if state is not None else verify(folder)
        if problem is None:
            return folder
        if state is None or state.is_main:
            warnings.warn(f"skipping checkpoint {folder}: {problem}", stacklevel=2)
    return None


# -- save ----------------------------------------------------------------------------------------
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
    listing = [_files(work) if state.is_main else None]
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


def barrier(state) -> None:
    """Wait for every rank on the host group (gloo, the save timeout): nothing else runs meanwhile."""
    if state.distributed:
        dist.barrier(group=state.host_group)


# -- read ----------------------------------------------------------------------------------------
def read_meta(folder: str) -> dict:
    path = os.path.join(folder, "meta.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {folder} is no fpscale checkpoint folder "
                              f"(runs/<name>/checkpoints/step_...)")
    with open(path) as fh:
        return json.load(fh)


def prepare_universal(folder: str, state) -> None:
    """Rank 0 converts ``folder`` to DeepSpeed's universal checkpoint (once); every rank waits for it."""
    if state.is_main:
        universal_folder(folder)
    barrier(state)


def universal_folder(folder: str) -> str:
    """DeepSpeed's universal checkpoint of ``folder``, converted on the first call (on one process)."""
    root = os.path.dirname(folder)
    out = os.path.join(root, "universal", os.path.basename(folder))
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", folder,
           "--output_folder", tmp, "--num_extract_workers", workers, "--num_merge_workers", workers]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if proc.returncode:
        raise RuntimeError(f"DeepSpeed could not convert {folder} to a universal checkpoint:\n"
                              f"{(proc.stdout + proc.stderr)[-3000:]}")
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def rank_states(folder: str) -> list[dict]:
    names = sorted(f for f in os.listdir(folder) if f.startswith("fpscale_rank"))
    return [torch.load(os.path.join(folder, n), map_location="cpu", weights_only=True) for n in names]


def whole_buffers(folder: str, meta: dict) -> dict[str, torch.Tensor]:
    """The model's buffers (e.g. power-iteration vectors) merged over the checkpoint's TP ranks."""
    by_tp = {}
    for rs in rank_states(folder):
        if rs["dp_rank"] == 0:
            by_tp[rs["tp_rank"]] = rs["buffers"]
    pieces = [by_tp[r] for r in range(meta["tp"])]
    out = {}
    for name in pieces[0]:
        if name in meta["split"]:
            dim, parts = meta["split"][name]
            out[name] = unshard([p[name] for p in pieces], dim, parts)
        else:
            out[name] = pieces[0][name]
    return out


def load_buffers(model, whole: dict[str, torch.Tensor], state) -> None:
    """Put whole buffers into this rank's model, split for its TP rank where the model splits them."""
    split = split_info(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            value = whole[name]
            if name in split:
                dim, parts = split[name]
                value = shard(value, dim, state.tp_rank, state.tp_size, parts)
            buf.copy_(value.to(buf.device, buf.dtype))


def whole_weights(source: str, state=None) -> tuple[dict[str, torch.Tensor], dict]:
    """(whole state dict, resolved config) of ``source``: a checkpoint of any layout (one process,
    DeepSpeed ZeRO 0-3, any TP x DP) or exported weights (a folder with model.safetensors and
    config.yaml, or the .safetensors file). The one way fpscale loads whole weights: evaluation,
    export and ``train.init_weights`` all call it. With ``state`` every rank calls it, and rank 0
    converts a DeepSpeed checkpoint to a universal one (once) while the others wait."""
    exported = source if source.endswith(".safetensors") else os.path.join(source, "model.safetensors")
    if os.path.exists(exported):
        return _exported(exported)
    if not os.path.exists(os.path.join(source, "meta.json")):
        raise CheckpointError(f"{source} holds neither a checkpoint (meta.json) nor exported weights "
                              f"(model.safetensors): give a runs/<name>/checkpoints/step_... folder or the "
                              f"output of launch/convert.py")
    meta = read_meta(source)
    if meta["kind"] == "single":
        return torch.load(os.path.join(source, "model.pt"), map_location="cpu", weights_only=True), meta["config"]
    if state is not None:
        prepare_universal(source, state)
    return _from_universal(source, meta), meta["config"]


def _exported(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Exported weights and the config beside them ({} where there is none)."""
    import yaml
    from safetensors.torch import load_file
    config_path = os.path.join(os.path.dirname(path), "config.yaml")
    config = {}
    if os.path.exists(config_path):
        with open(config_path) as fh:
            config = yaml.safe_load(fh)
    return load_file(path), config


def _from_universal(folder: str, meta: dict) -> dict[str, torch.Tensor]:
    """The whole state dict of a DeepSpeed checkpoint: parameters from its universal checkpoint
    (converted on the first call), buffers merged from the rank files."""
    universal = universal_folder(folder)
    buffers = whole_buffers(folder, meta)
    sd = {}
    zero = os.path.join(universal, "zero")
    for name, shape in meta["shapes"].items():
        if name in buffers:
            continue
        path = os.path.join(zero, name, "fp32.pt")
        # written by DeepSpeed's converter (a dict holding its SubparamShape objects; a flat tensor
        # after ZeRO-3), hence the full load of a file this machine just wrote
        value = torch.load(path, map_location="cpu", weights_only=False)
        value = value["param"] if isinstance(value, dict) else value
        if value.numel() != torch.Size(shape).numel():
            raise CheckpointError(f"{path}: {value.numel()} values for {name} of shape {shape}")
        sd[name] = value.reshape(shape)
    sd.update(buffers)
    return sd


def load_model(source: str, state=None, cfg: Config | None = None):
    """(plain model holding the whole weights of ``source``, its Config), ready for
    ``parallelize``; the model is built from ``cfg``, or else from the config saved with
    ``source``. ``source`` and ``state`` as for :func:`whole_weights`."""
    weights, config = whole_weights(source, state)
    if cfg is None:
        if not config:
            raise CheckpointError(f"{source} has no config.yaml beside its weights: give the model's config")
        cfg = from_dict(Config, config)
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{source} does not fit this model: missing {missing}, unexpected {unexpected}")
    return model, cfg


def export_safetensors(source: str, out: str) -> None:
    """The whole weights of ``source`` (any layout) as ``out/model.safetensors`` plus ``out/config.yaml``."""
    import yaml
    from safetensors.torch import save_file
    weights, config = whole_weights(source)
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.yaml"), "w") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
