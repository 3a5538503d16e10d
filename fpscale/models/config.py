"""Model configuration: a decoder LM assembled from a list of layer specs.

Each entry of ``model.layers`` is the config section of its layer type (fpscale.layers.registry);
the built-in types register in fpscale/layers/__init__.py, one line each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fpscale.errors import check
from fpscale.layers import AttnSpec, LayerSpec
from fpscale.layers.checkpointing import check_mode
from fpscale.layers.step_cache import CACHE_MODES
from fpscale.ops.fused_loss import LOSS_KERNELS


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
    embed_init: str = "normal"    # normal (std init_std) | trunc_orthogonal: jacobfa/Attractor's embedding, a
    # truncated-orthogonal table with entries of std init_std (fpscale.layers.switches.trunc_orthogonal_)
    embed_scale: float = 1.0      # token embeddings enter the stack times this (the tied output layer
    # reads the table unscaled); Epsilon's authors use sqrt(d_model): its CenterNorm keeps the scale
    tie_embeddings: bool = True
    loss_chunk: int = 4096        # the loss from the hidden states this many tokens at a time, never the
    # whole logits (fpscale.ops.chunked_loss: same value and gradients); 0: logits, then their loss
    loss_kernel: str = "chunked"  # chunked (fpscale.ops.chunked_loss) or liger (liger-kernel's fused linear
    # cross-entropy where Triton runs: fpscale.ops.fused_loss); the chunked head until a GPU has timed both
    dropout: float = 0.0          # on the residual branches of attn, fpsa and fpmamba blocks
    attn_dropout: float = 0.0     # on the attention probabilities of attn layers
    # never inside a fixed-point map: a mask that changed between iterations leaves no fixed point
    checkpoint: str = "none"      # none | mlp | block: recompute plain sublayers in backward
    # (fpscale.layers.checkpointing); model.layers.N.checkpoint overrides it per entry
    layers: list[LayerSpec] = field(default_factory=lambda: [AttnSpec(repeat=2)])
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
        check(self.embed_init in ("normal", "trunc_orthogonal"), f"{prefix}.embed_init",
              f"must be normal or trunc_orthogonal, got {self.embed_init!r}")
        check(self.embed_scale > 0, f"{prefix}.embed_scale", f"must be > 0, got {self.embed_scale}")
        check(self.mlp_ratio > 0, f"{prefix}.mlp_ratio", f"must be > 0, got {self.mlp_ratio}")
        check(self.loss_chunk >= 0, f"{prefix}.loss_chunk",
              f"must be >= 0 (tokens per chunk of the loss; 0: the plain head), got {self.loss_chunk}")
        check(self.loss_kernel in LOSS_KERNELS, f"{prefix}.loss_kernel",
              f"must be one of {', '.join(LOSS_KERNELS)}, got {self.loss_kernel!r}")
        check(self.max_seq_len >= 1, f"{prefix}.max_seq_len", f"must be >= 1, got {self.max_seq_len}")
        check(len(self.layers) >= 1, f"{prefix}.layers", "needs at least one layer spec")
        check_mode(self.checkpoint, f"{prefix}.checkpoint")
        for i, spec in enumerate(self.layers):
            if spec.checkpoint is not None:
                check_mode(spec.checkpoint, f"{prefix}.layers.{i}.checkpoint")
            spec.validate_in(self, f"{prefix}.layers.{i}")
        supervised = [i for i, spec in enumerate(self.layers) if spec.looped and spec.deep_supervision.window > 0]
        for i in supervised[1:]:     # the windows of one layer decode through the rest of the model
            check(False, f"{prefix}.layers.{i}.deep_supervision.window",
                  f"deep supervision is on for model.layers.{supervised[0]} already: one layer of a model "
                  f"takes it (the others solve inside its windows' decoding)")
        for i in supervised:
            check(self.layers[i].repeat == 1, f"{prefix}.layers.{i}.repeat",
                  f"must be 1 where deep_supervision is on (one supervised layer), got {self.layers[i].repeat}")

    def expanded_layers(self) -> list[LayerSpec]:
        return [spec for spec in self.layers for _ in range(spec.repeat)]

    def out_init_std(self, sublayers: int | None = None) -> float:
        """Init std of the projections that write into the residual stream (GPT-2 scaling by
        the number of residual sublayers; by default two per layer of the model)."""
        return self.init_std / (sublayers or 2 * len(self.expanded_layers())) ** 0.5



@dataclass
class DecodeConfig:
    """``decode``: how cached decoding keeps the looped layers' past (docs/decoding.md).
    ``cache: exact`` keeps what each fixed-point layer's map reads of a past token at every iteration,
    so decoding repeats the full forward exactly (the reference); ``fixed_point`` keeps one entry per past
    token, the fixed point's, a plain model's cache size, equal to the full forward where the solves
    converged. ``compact`` (both modes): a batch's solve runs its map only on the rows not yet done
    (fpscale.solvers.rows), so a row that converged stops paying for the slowest one's iterations."""

    cache: str = "exact"
    compact: bool = True

    def validate(self, prefix: str = "decode") -> None:
        check(self.cache in CACHE_MODES, f"{prefix}.cache",
              f"must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")
        check(isinstance(self.compact, bool), f"{prefix}.compact", f"must be true or false, got {self.compact!r}")
