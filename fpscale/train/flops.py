"""Matmul FLOPs per token of each layer, nominal and executed.

A looped layer's forward costs ``static + per_iter * iterations``. Training FLOPs per token are
  nominal   3 x (static + per_iter): as if every looped layer ran once (forward + 2x backward)
  executed  the forward iterations actually taken, plus what the backward mode costs:
            unroll   2 x per_iter x iterations           phantom/jfb   3 x per_iter x k
            implicit 3 x per_iter (the recorded f and its parameter gradient) + 2 x per_iter per
                     adjoint iteration (one vector-Jacobian product each)
plus 3 x static for every layer. Attention scores are counted causally (T/2 keys on average).
The per-layer formulas live with their layer types (``flops`` of each spec in fpscale/models/).
"""
from __future__ import annotations

from fpscale.models.config import ModelConfig


def layer_flops(cfg: ModelConfig, seq_len: int) -> list[tuple[float, float]]:
    """(static, per_iteration) forward FLOPs per token for every expanded layer (each layer type
    declares its own: ``LayerSpec.flops``, fpscale.models.registry)."""
    return [spec.flops(cfg, seq_len) for spec in cfg.expanded_layers()]


def head_flops(cfg: ModelConfig) -> float:
    return 2 * cfg.d_model * cfg.vocab_size


def training_flops(cfg: ModelConfig, seq_len: int, layer_stats: list[dict | None],
                   backward_modes: list[str], phantom_steps: list[int]) -> tuple[float, float]:
    """(nominal, executed) training FLOPs per token; ``layer_stats[i]`` is None for attn layers,
    else that layer's mean ``iterations`` (and ``backward_iterations``) over the interval."""
    nominal = executed = 3 * head_flops(cfg)
    for (static, per_iter), stats, mode, k in zip(layer_flops(cfg, seq_len), layer_stats, backward_modes,
                                                  phantom_steps):
        nominal += 3 * (static + per_iter)
        if stats is None:
            executed += 3 * static
            continue
        its = stats["iterations"]
        if mode == "unroll":
            back = 2 * per_iter * its
        elif mode == "implicit":
            back = 3 * per_iter + 2 * per_iter * stats.get("backward_iterations", 0)
        else:
            back = 3 * per_iter * (1 if mode == "jfb" else k)
        executed += 3 * static + per_iter * its + back
    return nominal, executed


PEAK_TFLOPS = {   # dense peak per device, by precision
    ("H100", "bf16"): 989.0, ("H100", "fp32"): 67.0, ("H200", "bf16"): 989.0, ("H200", "fp32"): 67.0,
    ("A100", "bf16"): 312.0, ("A100", "fp32"): 19.5,
}


def peak_tflops(device_name: str, precision: str, configured: float) -> float | None:
    """The configured peak, else a known GPU's; None when unknown (MFU is then not reported)."""
    if configured > 0:
        return configured
    for (name, prec), value in PEAK_TFLOPS.items():
        if name in device_name and prec == precision:
            return value
    return None
