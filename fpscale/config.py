"""The run configuration: typed sections loaded from YAML plus ``key.sub=value`` overrides.

    cfg = fpscale.load_config("configs/tiny_mixed.yaml", overrides=["solver.forward.max_iter=12"])

Every section validates itself on load; a mistake raises :class:`fpscale.ConfigError` naming
the key and the constraint it broke. What works but not as asked warns, naming the key: a
``stop_quantile`` that tolerates no sample at this micro-batch, or (in bf16) a solver tolerance
below what bf16 resolves, which is raised to the floor (the run's config.yaml records it). A key
in an older form (a flat ``solver.tol``) loads with a ``ConfigDeprecation`` naming today's key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fpscale.data.config import DataConfig
from fpscale.errors import check, warn
from fpscale.models.config import DecodeConfig, ModelConfig
from fpscale.parallel.config import ParallelConfig
from fpscale.solvers.config import PART_OF, SolverConfig, key_of
from fpscale.solvers.iterate import quantile_limit
from fpscale.solvers.precision import residual_floor, unreachable
from fpscale.train.config import TrainConfig
from fpscale.typed import apply_override, from_dict, load_yaml, merge, to_dict, upgrade_data


@dataclass
class Config:
    name: str = "run"
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)   # default for every looped layer
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)     # cached decoding (docs/decoding.md)

    def validate(self, prefix: str = "") -> None:
        check(bool(self.name) and "/" not in self.name, "name",
              f"must be a non-empty run name without '/', got {self.name!r}")
        check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
              f"must not exceed model.max_seq_len: {self.data.seq_len} > {self.model.max_seq_len}")
        tokens, seq = self.train.global_batch_tokens, self.data.seq_len
        if tokens:        # the recipe's token count fixes the global batch (config.yaml records both)
            check(tokens % seq == 0, "train.global_batch_tokens",
                  f"must be a whole number of sequences of data.seq_len {seq}: {tokens} / {seq} = {tokens / seq:g}")
            self.train.global_batch = tokens // seq
        if self.train.micro_batch != "auto":        # auto: checked when the trainer resolves it
            self._check_solvers(self.train.micro_batch)
        if self.data.source == "shards" and self.data.blend:
            # the blend's sources on disk: one tokenizer, one that model.vocab_size holds
            from fpscale.data.blend import check_data
            check_data(self.data, self.model.vocab_size)

    def check_micro_batch(self, micro_batch: int) -> None:
        """Warn where a layout's micro-batch (``resolve_batch``, smaller than ``train.micro_batch``)
        leaves a looped layer's quantile stop inert."""
        if micro_batch != self.train.micro_batch:
            self._check_solvers(micro_batch)

    def _check_solvers(self, micro_batch: int) -> None:
        warnings: dict[str, str] = {}            # one per key, however many layers share it
        for i, spec in enumerate(self.model.layers):
            if spec.looped:      # its solver overrides must form a valid solver config
                solver = self.solver.with_overrides(spec.solver, f"model.layers.{i}.solver")
                warnings.update(self._check_solver(i, spec.solver, solver, micro_batch))
        for key, message in warnings.items():
            warn(key, message)

    def _check_solver(self, i: int, overrides: dict, solver: SolverConfig, mb: int) -> dict[str, str]:
        """What a looped layer's solver can do in this run's geometry and precision: {key: warning}.
        A tolerance below bf16's floor is raised where it was set (this layer's overrides or the
        top-level section)."""
        def mine(name: str) -> bool:           # set by this layer's overrides
            return name in overrides.get(PART_OF[name], {})

        def key(name: str) -> str:
            return key_of(name, f"model.layers.{i}.solver" if mine(name) else "solver")

        out = {}
        p = solver.stop_quantile
        if p > 0 and quantile_limit(p, mb) == 0:
            out[key("stop_quantile")] = (f"{p} x micro-batch {mb} = {p * mb:.3g} < 1: the rule tolerates no "
                                         f"unconverged sample, the same as 0 (the quantile stop needs p >= 1/{mb} "
                                         f"= {1 / mb:.3g})")
        if self.train.precision != "bf16":
            return out
        floor = residual_floor(torch.bfloat16, norm=solver.norm)
        for name in ("tol", "backward_tol") if solver.backward == "implicit" else ("tol",):   # neumann1: no tol
            if unreachable(getattr(solver, name), torch.bfloat16, norm=solver.norm):
                out[key(name)] = (f"{getattr(solver, name):g} is below what a bf16 map resolves (relative residual "
                                  f"floor {floor:.3g}, docs/solver.md 'Precision'): raised to {floor:.3g}")
                if mine(name):
                    overrides[PART_OF[name]][name] = floor
                else:
                    setattr(getattr(self.solver, PART_OF[name]), name, floor)
        return out


def config_from_dict(data: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Defaults, then ``data`` (YAML), then the overrides, so an override can reach any key. Keys in an
    older form are brought to today's (``upgrade_data``) before the defaults and after each override."""
    if not isinstance(data, dict):
        raise TypeError("config data must be a mapping")
    section = data.get("parallel") or {}
    # ZeRO asked for by the YAML (one that names no engine: a run's own config.yaml names it) or ...
    asked = "zero_stage" in section and "engine" not in section
    base = to_dict(Config())
    # the default layer entries as their type and non-default fields only: an override that changes an
    # entry's type (model.layers.0.type=fpsa) must not carry the fields of the default type along
    base["model"]["layers"] = [_set_fields(spec) for spec in Config().model.layers]
    data = merge(base, upgrade_data(Config, data))
    for override in overrides:
        apply_override(data, override)
        data = upgrade_data(Config, data)
        asked = asked or override.split("=", 1)[0].strip() == "parallel.zero_stage"     # ... by an override
    cfg = from_dict(Config, data)
    if cfg.parallel.engine == "auto" and asked and cfg.parallel.zero_stage > 0:
        cfg.parallel.engine = "deepspeed"      # ZeRO asked for: DeepSpeed, one process too (parallel.engine)
    return cfg


def _set_fields(spec) -> dict[str, Any]:
    """A layer spec as YAML data: ``type`` and the fields that differ from their defaults."""
    import dataclasses
    out = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if f.name == "type" or value != default:
            out[f.name] = to_dict(value)
    return out


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (YAML; None = all defaults), apply ``overrides`` and validate."""
    return config_from_dict(load_yaml(path) if path else {}, overrides)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return to_dict(cfg)
