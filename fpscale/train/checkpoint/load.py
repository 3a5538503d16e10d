"""Loading: whole weights from a checkpoint of any layout (through DeepSpeed's universal checkpoint
when TP or ZeRO shards it), an exported safetensors file, the model's buffers; export to safetensors.
Resuming a run (optimizer, data position, RNG) is fpscale.train.resume."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from fpscale.config import Config
from fpscale.errors import CheckpointError
from fpscale.models import build_model
from fpscale.parallel.layers import shard, unshard
from fpscale.train.checkpoint.format import barrier, rank_states, read_meta, split_info
from fpscale.typed import from_dict


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

