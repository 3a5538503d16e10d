"""jacobfa/Attractor's save_pretrained folders in and out of fpscale (``launch/convert.py --from attractor``,
``--to attractor``): files around fpscale.models.attractor_weights, which maps the tensors and configs."""
from __future__ import annotations

import json
import os

import torch

from fpscale.models.attractor_weights import fpscale_config, read_their_folder, their_config, to_fpscale, to_theirs

BASE = "attractor_config.json"     # their config.json as read, beside the converted weights


def import_folder(folder: str, out: str, name: str | None = None) -> None:
    """Their save_pretrained folder -> fpscale's whole weights (``out/model.safetensors`` + ``config.yaml``,
    what ``launch/convert.py --weights`` shards and ``train.init_weights`` loads)."""
    import yaml
    from safetensors.torch import save_file

    from fpscale.config import config_from_dict
    from fpscale.typed import to_dict
    sd, their = read_their_folder(folder)
    data = fpscale_config(their)
    data["name"] = name or str(their.get("name") or "attractor").replace("/", "_") or "attractor"
    data["data"] = {"seq_len": data["model"]["max_seq_len"]}
    cfg = config_from_dict(data)
    os.makedirs(out, exist_ok=True)
    save_file(to_fpscale(sd, their), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.yaml"), "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    with open(os.path.join(out, BASE), "w") as fh:     # what fpscale's config does not hold (their_config)
        json.dump(their, fh, indent=2)


def export_folder(source: str, out: str) -> None:
    """fpscale weights (a checkpoint of any layout, or exported weights) -> their folder: config.json and
    model.pt (their ``from_pretrained`` reads model.pt) plus model.safetensors with the same tensors."""
    from safetensors.torch import save_file

    from fpscale.config import config_from_dict
    from fpscale.train.checkpoint import whole_weights
    weights, config = whole_weights(source)
    cfg = config_from_dict(config)
    sd = to_theirs(weights, cfg.model)
    os.makedirs(out, exist_ok=True)
    base = None
    if os.path.isfile(os.path.join(source, BASE)):
        with open(os.path.join(source, BASE)) as fh:
            base = json.load(fh)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(their_config(cfg, base), fh, indent=2)
    torch.save(sd, os.path.join(out, "model.pt"))
    save_file({k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}, os.path.join(out, "model.safetensors"))
