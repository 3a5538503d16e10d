"""Tiny models of each layer type for the tests."""
from __future__ import annotations

import torch

import fpscale
from fpscale.models import ModelConfig, layer_spec

TYPES = ["attn", "fpsa", "fpmamba", "looped"]


def tiny_config(layer_type: str, vocab: int = 32, d: int = 32, solver: dict | None = None, **spec):
    cfg = fpscale.load_config(None, [])
    layers = [layer_spec(layer_type, **spec)] if layer_type != "mixed" else [
        layer_spec(t) for t in ("attn", "fpsa", "fpmamba", "looped")]
    if solver:
        for layer in layers:
            if layer.looped:
                layer.solver = dict(solver)
    cfg.model = ModelConfig(vocab_size=vocab, d_model=d, n_heads=4, max_seq_len=128, layers=layers)
    cfg.model.validate()
    return cfg


def tiny_model(layer_type: str, seed: int = 0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return fpscale.build_model(tiny_config(layer_type, **kw)).to(dtype)


TINY_LOOPED_CONFIGS = ["tiny_fpsa", "tiny_fpmamba", "tiny_looped", "tiny_mixed"]


def token_batches(vocab: int, n: int = 2, batch: int = 4, seq: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """``n`` batches of random tokens. The default is test_precision's (bf16 beside fp32), 8 x 128 before:
    at 4 x 64 each tiny config's looped layers took the mean iterations in .to(bfloat16) and autocast
    that they took at 8 x 128, against fp32's (fpsa 2.5/2.5 vs 2.0 in eval, fpmamba 3 = 3, looped equal
    to fp32: 4.5 here, 5.0 there), in a quarter of the time."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


@torch.no_grad()
def solver_iterations(forward, model, batches, training: bool, autocast: bool = False) -> dict[str, list]:
    """{layer: [(iterations, stopped_by) per batch]} of every looped layer; ``forward`` is the model
    (or its ``hidden``, which skips the output projection) or its DeepSpeed engine, ``model`` the
    LoopedLM (its solver statistics)."""
    model.train(training)
    out: dict[str, list] = {}
    for tokens in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            forward(tokens[:, :-1])
        for name, stats in model.solver_stats().items():
            out.setdefault(name, []).append((stats.iterations, stats.stopped_by))
    return out


def assert_iterates_alike(fp32: dict, other: dict, what: str) -> None:
    """Mean iterations per layer within 1.25x of fp32's, and no solve that converged in fp32
    (by tolerance or quantile) runs to its cap in the other precision."""
    assert fp32.keys() == other.keys()
    for name in fp32:
        a = sum(i for i, _ in fp32[name]) / len(fp32[name])
        b = sum(i for i, _ in other[name]) / len(other[name])
        assert max(a, b) <= 1.25 * min(a, b), f"{what} {name}: {b:.2f} iterations vs fp32 {a:.2f} ({other[name]})"
        for (_, why32), (_, why) in zip(fp32[name], other[name]):
            assert not (why32 in ("converged", "quantile") and why == "max_iter"), f"{what} {name}: {other[name]}"
