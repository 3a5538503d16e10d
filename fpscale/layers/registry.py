"""The layer registry: what a type of ``model.layers`` entry is, in one place.

A layer type is one dataclass, a subclass of :class:`LayerSpec` (or :class:`FixedPointSpec` for a
looped type, which adds the per-layer ``solver`` overrides). It declares

  its config section   the dataclass fields: a key that does not belong to the type is an error
  its block            ``build(cfg, solver)``: the nn.Module one entry of the stack becomes
  its TP constraints   ``tp_divisors(cfg)``: the sizes ``parallel.tp`` must divide. How each
                       weight splits is declared by the modules themselves (``tp_plan``, see
                       fpscale.layers.common.TPSplit), so a block built of existing modules
                       needs no split rules of its own
  its FLOPs per token  ``flops(cfg, seq_len)``: (static, per solver iteration), forward, matmuls

The built-in types register in fpscale/layers/__init__.py (one line each); a type defined
elsewhere (a user's package, a test) registers with ``register_layer(MySpec)`` before its
config is loaded:

    @dataclass
    class ScaledSpec(FixedPointSpec):
        type: str = "scaled"
        def build(self, cfg, solver): return ScaledBlock(cfg, self, solver)
        ...
    register_layer(ScaledSpec)
    cfg = fpscale.load_config(None, ["model.layers=[{type: scaled}]"])
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fpscale.errors import ConfigError, check
from fpscale.typed import from_dict, nest

if TYPE_CHECKING:
    import torch

    from fpscale.models.config import ModelConfig
    from fpscale.solvers import SolverConfig


@dataclass
class LayerSpec:
    """One entry of ``model.layers``: ``type`` picks the registered dataclass, ``repeat`` copies
    the entry (each copy has its own weights); ``checkpoint`` overrides ``model.checkpoint`` for
    it (fpscale.layers.checkpointing; None: the global mode); ``init`` names the parameter
    initialisation, one of the type's ``inits`` (every type has ``fpscale``, its own; a type that
    reproduces a peer's starting point adds that one, e.g. fpmamba's ``authors``)."""

    type: str
    repeat: int = 1
    checkpoint: str | None = None
    init: str = "fpscale"

    looped: ClassVar[bool] = False       # True: a fixed-point layer, with a solver
    inits: ClassVar[tuple[str, ...]] = ("fpscale",)     # the values of ``init`` this type builds

    @classmethod
    def select(cls, data: dict[str, Any], key: str) -> type[LayerSpec]:
        """The registered dataclass that ``data`` (one YAML entry) names by its ``type``."""
        if "type" not in data:
            raise ConfigError(f"{key}.type", f"is required: one of {', '.join(LAYER_TYPES)}")
        return spec_class(data["type"], f"{key}.type")

    def validate(self, prefix: str = "") -> None:
        check(self.repeat >= 1, f"{prefix}.repeat", f"must be >= 1, got {self.repeat}")
        check(self.init in self.inits, f"{prefix}.init",
              f"layer type {self.type!r} has no initialisation {self.init!r}: one of {' | '.join(self.inits)}")

    def validate_in(self, cfg: ModelConfig, prefix: str) -> None:
        """Constraints that involve the model's sizes (checked by ModelConfig.validate)."""

    def build(self, cfg: ModelConfig, solver: SolverConfig | None) -> torch.nn.Module:
        raise NotImplementedError(f"layer type {self.type!r} does not define build()")

    def tp_divisors(self, cfg: ModelConfig) -> list[tuple[str, int]]:
        """(what, size) pairs that ``parallel.tp`` must divide for this layer to split."""
        raise NotImplementedError(f"layer type {self.type!r} does not define tp_divisors()")

    def flops(self, cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
        """(static, per_iteration) forward matmul FLOPs per token: a looped layer's forward costs
        ``static + per_iteration * iterations``; a one-pass layer has per_iteration 0."""
        raise NotImplementedError(f"layer type {self.type!r} does not define flops()")


@dataclass
class DeepSupervision:
    """Deep supervision with truncated-backprop windows (seed 004, Algorithm 2 and App. D;
    fpscale.layers.deep_supervision): in training, the layer's solve runs in windows of ``window``
    iterations; after each window the rest of the model and the head decode the current state, the
    loss of that window is backpropagated through its ``window`` iterations only, and the state is
    detached. The solver's stop ends the windows; a final window at the stop is supervised as
    training without deep supervision is (the configured backward mode at the fixed point).
    ``window: 0`` (default): off."""

    window: int = 0

    def validate(self, prefix: str = "") -> None:
        check(self.window >= 0, f"{prefix}.window",
              f"must be >= 0 (iterations per supervised window; 0 = off), got {self.window}")


@dataclass
class FixedPointSpec(LayerSpec):
    """A looped layer type: ``solver`` overrides the top-level ``solver`` section for it;
    ``deep_supervision`` supervises its solve in windows (:class:`DeepSupervision`)."""

    solver: dict[str, Any] = field(default_factory=dict)
    deep_supervision: DeepSupervision = field(default_factory=DeepSupervision)

    looped: ClassVar[bool] = True

    @classmethod
    def upgrade(cls, data: dict[str, Any], key: str) -> dict[str, Any]:
        """Flat solver overrides (``solver: {tol: 0.1}``, the form before the solver's parts) move into
        their part, one ConfigDeprecation each (``SolverConfig.upgrade``); the solver checks the keys."""
        if not isinstance(data.get("solver"), dict):
            return data
        from fpscale.solvers.config import PART_OF
        return {**data, "solver": nest(data["solver"], PART_OF, f"{key}.solver")}


LAYER_TYPES: dict[str, type[LayerSpec]] = {}


def register_layer(spec: type[LayerSpec]) -> type[LayerSpec]:
    """Register a layer type under the default of its ``type`` field (usable as a decorator)."""
    if not (isinstance(spec, type) and issubclass(spec, LayerSpec) and dataclasses.is_dataclass(spec)):
        raise TypeError(f"register_layer takes a LayerSpec dataclass, got {spec!r}")
    name = next(f.default for f in dataclasses.fields(spec) if f.name == "type")
    if not isinstance(name, str):
        raise TypeError(f"{spec.__name__} must give its 'type' field a default: the name it registers under")
    if LAYER_TYPES.get(name, spec) is not spec:
        raise ValueError(f"layer type {name!r} is already registered (by {LAYER_TYPES[name].__name__})")
    LAYER_TYPES[name] = spec
    return spec


def spec_class(name: Any, key: str = "type") -> type[LayerSpec]:
    if name not in LAYER_TYPES:
        raise ConfigError(key, f"unknown layer type {name!r}; registered types: {', '.join(LAYER_TYPES)}")
    return LAYER_TYPES[name]


def layer_spec(type: str, **fields: Any) -> LayerSpec:
    """A layer spec built in code: ``layer_spec("fpmamba", mixer="dplr")`` (fields are checked
    as the YAML's are, naming a key that does not belong to the type)."""
    return from_dict(spec_class(type), {"type": type, **fields}, "layer")
