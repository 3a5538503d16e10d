"""Matmul FLOPs per token of each layer, nominal and executed.

A looped layer's forward costs ``static + per_iter * iterations``. Training FLOPs per token are
  nominal   3 x (static + per_iter): as if every looped layer ran once (forward + 2x backward)
  executed  the forward iterations actually taken, plus what the backward mode costs:
            unroll   2 x per_iter x iterations           phantom/jfb   3 x per_iter x k
            implicit 3 x per_iter (the recorded f and its parameter gradient) + 2 x per_iter per
                     adjoint iteration (one vector-Jacobian product each)
            once     2 x per_iter: a layer whose f does not read its iterate applies f once, the
                     differentiable application (its one iteration), and autograd goes through it
plus 3 x static for every layer. Attention scores are counted causally (T/2 keys on average).
A layer with deep supervision (fpscale.layers.deep_supervision) adds, per supervised window of K
iterations, the window recomputed and differentiated (3 x per_iter x K) and the rest of the model
after it and the head, run in the forward, recomputed and differentiated (4 x their forward).
The per-layer formulas live with their layer types (``flops`` of each spec in fpscale/models/).
"""
from __future__ import annotations

from fpscale.models.config import ModelConfig


def layer_flops(cfg: ModelConfig, seq_len: int) -> list[tuple[float, float]]:
    """(static, per_iteration) forward FLOPs per token for every expanded layer (each layer type
    declares its own: ``LayerSpec.flops``, fpscale.layers.registry)."""
    return [spec.flops(cfg, seq_len) for spec in cfg.expanded_layers()]


def head_flops(cfg: ModelConfig) -> float:
    return 2 * cfg.d_model * cfg.vocab_size


def training_flops(cfg: ModelConfig, seq_len: int, layer_stats: list[dict | None],
                   backward_modes: list[str], phantom_steps: list[int]) -> tuple[float, float]:
    """(nominal, executed) training FLOPs per token; ``layer_stats[i]`` is None for attn layers,
    else that layer's mean ``iterations`` (and ``backward_iterations``) over the interval."""
    nominal = executed = 3 * head_flops(cfg)
    per_layer = layer_flops(cfg, seq_len)
    forward = [static + per_iter * (stats["iterations"] if stats else 0)
               for (static, per_iter), stats in zip(per_layer, layer_stats)]
    for i, ((static, per_iter), stats) in enumerate(zip(per_layer, layer_stats)):
        if stats and stats.get("windows"):       # deep supervision's windows
            after = sum(forward[i + 1:]) + head_flops(cfg)      # the coda and the head
            executed += stats["windows"] * (3 * per_iter * stats["window"] + 4 * after)
    for (static, per_iter), stats, mode, k in zip(per_layer, layer_stats, backward_modes, phantom_steps):
        nominal += 3 * (static + per_iter)
        if stats is None:
            executed += 3 * static
            continue
        its = stats["iterations"]
        if mode in ("unroll", "once"):
            back = 2 * per_iter * its
        elif mode in ("implicit", "neumann1"):
            back = 3 * per_iter + 2 * per_iter * stats.get("backward_iterations", 0)
        else:
            back = 3 * per_iter * (1 if mode == "jfb" else k)
        executed += 3 * static + per_iter * its + back
    return nominal, executed


# Dense (not 2:4 sparse) peak TFLOP/s per device from NVIDIA's data sheets: bf16 tensor cores, fp32 matmuls
# on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32), and plain fp32. The first row whose pattern
# torch.cuda.get_device_name() contains applies, so the variants come before their family.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("GH200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),      # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),      # SXM: "NVIDIA H200"
    ("B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),      # SXM4 and PCIe, 40 and 80 GB alike
]


def peak_tflops(device_name: str, precision: str, configured: float, tf32: bool = False) -> float | None:
    """``train.peak_tflops`` when set, else the peak of a known device (``PEAK_TFLOPS``) for
    ``precision`` (fp32 on TF32 tensor cores when ``tf32``); None for any other device, whose MFU
    is then not reported rather than rated against a neighbour's peak."""
    if configured > 0:
        return configured
    key = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, peaks in PEAK_TFLOPS:
        if pattern in device_name:
            return peaks.get(key)
    return None
