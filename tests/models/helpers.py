"""Tiny models of each layer type for the tests."""
from __future__ import annotations

import torch

import fpscale
from fpscale.models import LayerSpec, ModelConfig

TYPES = ["attn", "fpsa", "fpmamba", "looped"]


def tiny_config(layer_type: str, vocab: int = 32, d: int = 32, solver: dict | None = None, **spec):
    cfg = fpscale.load_config(None, [])
    layers = [LayerSpec(type=layer_type, **spec)] if layer_type != "mixed" else [
        LayerSpec(type=t) for t in ("attn", "fpsa", "fpmamba", "looped")]
    if solver:
        for layer in layers:
            layer.solver = dict(solver)
    cfg.model = ModelConfig(vocab_size=vocab, d_model=d, n_heads=4, max_seq_len=128, layers=layers)
    cfg.model.validate()
    return cfg


def tiny_model(layer_type: str, seed: int = 0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return fpscale.build_model(tiny_config(layer_type, **kw)).to(dtype)
