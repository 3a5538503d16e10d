"""A layer type defined outside fpscale, as a user would: one dataclass, one block, one
registration line. Nothing else in fpscale learns of it, yet it configures, trains, splits under
tensor parallelism and counts its FLOPs (tests/parallel/test_tensor_parallel.py, tests/models).

    z* = x + scale * MLP(norm(z*))      iterated from z = x; a contraction for small scale
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fpscale.errors import check
from fpscale.layers.common import MLP, RMSNorm, mlp_flops, mlp_tp_divisor, swiglu_hidden
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.models import FixedPointSpec, register_layer


class DampedMLP(FixedPointLayer):
    def __init__(self, cfg, spec, solver):
        super().__init__(solver)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio, cfg.init_std, cfg.out_init_std())   # declares its own TP split
        self.scale = spec.scale

    def forward(self, x: torch.Tensor, pos: int = 0, cache: dict | None = None) -> torch.Tensor:
        z = self.fixed_point(lambda z: x + self.scale * self.mlp(self.norm(z)), x)
        return z.to(x.dtype)


@dataclass
class DampedMLPSpec(FixedPointSpec):
    type: str = "damped_mlp"
    scale: float = 0.5

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(0.0 < self.scale < 1.0, f"{prefix}.scale", f"must lie in (0, 1), got {self.scale}")

    def build(self, cfg, solver) -> torch.nn.Module:
        return DampedMLP(cfg, self, solver)

    def tp_divisors(self, cfg) -> list[tuple[str, int]]:
        return [mlp_tp_divisor(cfg)]

    def flops(self, cfg, seq_len: int) -> tuple[float, float]:
        return 0.0, mlp_flops(cfg.d_model, swiglu_hidden(cfg.d_model, cfg.mlp_ratio))


register_layer(DampedMLPSpec)
