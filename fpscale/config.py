"""The run configuration: typed sections loaded from YAML plus ``key.sub=value`` overrides.

    cfg = fpscale.load_config("configs/tiny_mixed.yaml", overrides=["solver.max_iter=12"])

Every section validates itself on load; a mistake raises :class:`fpscale.ConfigError` naming
the key and the constraint it broke.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

from fpscale.data.config import DataConfig
from fpscale.errors import check
from fpscale.models.config import ModelConfig
from fpscale.parallel.config import ParallelConfig
from fpscale.solvers.config import SolverConfig
from fpscale.train.config import TrainConfig
from fpscale.typed import apply_override, from_dict, load_yaml, to_dict


@dataclass
class Config:
    name: str = "run"
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)   # default for every looped layer
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self, prefix: str = "") -> None:
        check(bool(self.name) and "/" not in self.name, "name",
              f"must be a non-empty run name without '/', got {self.name!r}")
        check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
              f"must not exceed model.max_seq_len: {self.data.seq_len} > {self.model.max_seq_len}")
        # every layer's solver overrides must form a valid solver config
        from fpscale.models.lm import layer_solver
        for i, spec in enumerate(self.model.layers):
            if spec.solver:
                layer_solver(self.solver, spec.solver, f"model.layers.{i}.solver")


def _merge(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` over ``base``: mappings merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_from_dict(data: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Defaults, then ``data`` (YAML), then the overrides, so an override can reach any key."""
    if not isinstance(data, dict):
        raise TypeError("config data must be a mapping")
    data = _merge(to_dict(Config()), data)
    for override in overrides:
        apply_override(data, override)
    return from_dict(Config, data)


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (YAML; None = all defaults), apply ``overrides`` and validate."""
    return config_from_dict(load_yaml(path) if path else {}, overrides)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return to_dict(cfg)
