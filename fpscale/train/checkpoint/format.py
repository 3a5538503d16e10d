"""The checkpoint format: folder names, the manifest (sizes and sha256 of every file, the hashing
dealt to the ranks by size), what describes a model independently of its layout (TP split
metadata, fingerprints, DeepSpeed's universal-checkpoint patterns), and reading a folder's metadata.
Saving is fpscale.train.checkpoint.save; loading and the universal conversion .load."""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings

import torch
import torch.distributed as dist

from fpscale.errors import CheckpointError
from fpscale.files import sha256_file, write_atomic

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


def list_files(folder: str) -> dict[str, int]:
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
    sizes = sizes if sizes is not None else list_files(folder)
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



def rank_states(folder: str) -> list[dict]:
    names = sorted(f for f in os.listdir(folder) if f.startswith("fpscale_rank"))
    return [torch.load(os.path.join(folder, n), map_location="cpu", weights_only=True) for n in names]

