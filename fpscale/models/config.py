"""Model configuration: a decoder LM assembled from a list of layer specs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fpscale.errors import check

LayerType = Literal["attn", "fpsa", "fpmamba", "looped"]


@dataclass
class LayerSpec:
    """One entry of ``model.layers``; ``repeat`` copies it (each copy has its own weights).

    solver      overrides of the top-level ``solver`` section for this layer (looped types)
    fpsa        spectral_norm (W_Q, W_K), temperature (learnable per-head softmax temperature)
    fpmamba     mixer (householder | dplr | kronecker | none), mixer_rank, negative_eigs
                (Householder a_i in (0, 2): negative eigenvalues, no contraction guarantee),
                d_state, expand, d_conv, y_feedback (B, C, Delta, Q see y_{t-1} of the last iterate)
    looped      core_blocks (attention + MLP blocks in the core: 2x sublayers), a1_init, a2_init,
                conv (causal depthwise conv branch on the re-injected input)
    """

    type: LayerType
    repeat: int = 1
    solver: dict[str, Any] = field(default_factory=dict)
    spectral_norm: bool = True
    temperature: bool = True
    mixer: Literal["householder", "dplr", "kronecker", "none"] = "householder"
    mixer_rank: int = 2
    negative_eigs: bool = False
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    y_feedback: bool = True
    core_blocks: int = 2
    a1_init: float = 0.5
    a2_init: float = 0.5
    conv: bool = False

    def validate(self, prefix: str = "") -> None:
        check(self.repeat >= 1, f"{prefix}.repeat", f"must be >= 1, got {self.repeat}")
        check(self.mixer_rank >= 1, f"{prefix}.mixer_rank", f"must be >= 1, got {self.mixer_rank}")
        check(self.d_state >= 1, f"{prefix}.d_state", f"must be >= 1, got {self.d_state}")
        check(self.expand >= 1, f"{prefix}.expand", f"must be >= 1, got {self.expand}")
        check(self.d_conv >= 1, f"{prefix}.d_conv", f"must be >= 1, got {self.d_conv}")
        check(self.core_blocks >= 1, f"{prefix}.core_blocks", f"must be >= 1, got {self.core_blocks}")
        for name in ("a1_init", "a2_init"):
            value = getattr(self, name)
            check(0.0 < value < 1.0, f"{prefix}.{name}", f"must lie in (0, 1), got {value}")


@dataclass
class IterationCap:
    """Randomised solver caps during training (seed 002: Gamma(4,1); 004: exponential;
    Huginn: log-normal Poisson). Drawn from a seed that is a function of the step, so every
    rank draws the same cap. ``mean`` is the mean cap; draws are clipped to [1, solver.max_iter]."""

    dist: Literal["none", "gamma", "exponential", "lognormal_poisson"] = "none"
    mean: float = 8.0
    sigma: float = 0.5

    def validate(self, prefix: str = "") -> None:
        check(self.mean >= 1.0, f"{prefix}.mean", f"must be >= 1, got {self.mean}")
        check(self.sigma > 0.0, f"{prefix}.sigma", f"must be > 0, got {self.sigma}")


@dataclass
class ModelConfig:
    vocab_size: int = 8000
    d_model: int = 128
    n_heads: int = 4
    mlp_ratio: float = 8 / 3
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = True
    dropout: float = 0.0          # on the residual branches of attn, fpsa and fpmamba blocks
    attn_dropout: float = 0.0     # on the attention probabilities of attn layers
    # never inside a fixed-point map: a mask that changed between iterations leaves no fixed point
    layers: list[LayerSpec] = field(default_factory=lambda: [LayerSpec(type="attn", repeat=2)])
    iteration_cap: IterationCap = field(default_factory=IterationCap)

    def validate(self, prefix: str = "model") -> None:
        check(self.vocab_size >= 2, f"{prefix}.vocab_size", f"must be >= 2, got {self.vocab_size}")
        check(self.d_model >= 1 and self.n_heads >= 1, f"{prefix}.d_model",
              f"d_model and n_heads must be >= 1, got {self.d_model}, {self.n_heads}")
        check(self.d_model % self.n_heads == 0, f"{prefix}.n_heads",
              f"must divide d_model: {self.d_model} % {self.n_heads} = {self.d_model % self.n_heads}")
        check((self.d_model // self.n_heads) % 2 == 0, f"{prefix}.n_heads",
              f"head dim d_model/n_heads = {self.d_model // self.n_heads} must be even for RoPE")
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"{prefix}.{name}", f"must lie in [0, 1), got {value}")
        check(self.mlp_ratio > 0, f"{prefix}.mlp_ratio", f"must be > 0, got {self.mlp_ratio}")
        check(self.max_seq_len >= 1, f"{prefix}.max_seq_len", f"must be >= 1, got {self.max_seq_len}")
        check(len(self.layers) >= 1, f"{prefix}.layers", "needs at least one layer spec")
        for i, spec in enumerate(self.layers):
            if spec.type == "fpmamba" and spec.mixer == "kronecker":
                d_inner = spec.expand * self.d_model
                d1 = kronecker_factors(d_inner)[0]
                check(d1 > 1, f"{prefix}.layers.{i}.mixer",
                      f"kronecker needs d_inner = {d_inner} to factor as d1*d2 with d1 > 1")

    def expanded_layers(self) -> list[LayerSpec]:
        return [spec for spec in self.layers for _ in range(spec.repeat)]

    def out_init_std(self, sublayers: int | None = None) -> float:
        """Init std of the projections that write into the residual stream (GPT-2 scaling by
        the number of residual sublayers; by default two per layer of the model)."""
        return self.init_std / (sublayers or 2 * len(self.expanded_layers())) ** 0.5


def kronecker_factors(n: int) -> tuple[int, int]:
    """The most balanced n = d1 * d2 with d1 <= d2."""
    d1 = int(n ** 0.5)
    while d1 > 1 and n % d1:
        d1 -= 1
    return d1, n // d1
