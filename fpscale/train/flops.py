"""Matmul FLOPs per token of each layer, nominal and executed.

A looped layer's forward costs ``static + per_iter * iterations``. Training FLOPs per token are
  nominal   3 x (static + per_iter): as if every looped layer ran once (forward + 2x backward)
  executed  the forward iterations actually taken, plus what the backward mode costs:
            unroll   2 x per_iter x iterations           phantom/jfb   3 x per_iter x k
            implicit 3 x per_iter (the recorded f and its parameter gradient) + 2 x per_iter per
                     adjoint iteration (one vector-Jacobian product each)
plus 3 x static for every layer. Attention scores are counted causally (T/2 keys on average).
"""
from __future__ import annotations

from fpscale.models.common import swiglu_hidden
from fpscale.models.config import ModelConfig, kronecker_factors


def _mixer(spec, di: int) -> float:
    feeds = 2 if spec.y_feedback else 1
    if spec.mixer in ("householder", "dplr"):            # u_i projections + application
        return feeds * 2 * spec.mixer_rank * di * di + 4 * spec.mixer_rank * di
    if spec.mixer == "kronecker":                        # K1, K2 projections, M M^T, 4 squarings, K1 V K2^T
        d1, d2 = kronecker_factors(di)
        return feeds * 2 * di * (d1 * d1 + d2 * d2) + 5 * 2 * (d1 ** 3 + d2 ** 3) + 2 * di * (d1 + d2)
    return 0.0


def _attention(d: int, T: int) -> float:
    return 2 * 3 * d * d + 2 * d * d + 2 * 2 * (T / 2) * d      # qkv, out, scores + values


def _mlp(d: int, hidden: int) -> float:
    return 2 * 3 * d * hidden


def layer_flops(cfg: ModelConfig, seq_len: int) -> list[tuple[float, float]]:
    """(static, per_iteration) forward FLOPs per token for every expanded layer."""
    d, T, hidden = cfg.d_model, seq_len, swiglu_hidden(cfg.d_model, cfg.mlp_ratio)
    out = []
    for spec in cfg.expanded_layers():
        if spec.type == "attn":
            out.append((_attention(d, T) + _mlp(d, hidden), 0.0))
        elif spec.type == "fpsa":   # V once; Q, K, scores/values, W_O per iteration
            out.append((2 * d * d + _mlp(d, hidden), 2 * 3 * d * d + 2 * 2 * (T / 2) * d))
        elif spec.type == "fpmamba":
            di, N = spec.expand * d, spec.d_state
            dt_rank = -(-d // 16)
            feeds = 2 if spec.y_feedback else 1
            per_iter = (_mixer(spec, di) + feeds * 2 * di * (dt_rank + 2 * N) + 2 * dt_rank * di
                        + 2 * 4 * di * N)                       # scan update and C^T h
            mlp = _mlp(d, hidden) if spec.mlp else 0.0
            out.append((2 * d * 2 * di + 2 * di * spec.d_conv + 2 * di * d + mlp, per_iter))
        else:                          # looped: the whole core per iteration
            out.append((0.0, spec.core_blocks * (_attention(d, T) + _mlp(d, hidden))))
    return out


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
