"""Parallel section of the run config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fpscale.errors import check

ENGINES = ("auto", "deepspeed", "torch")


@dataclass
class ParallelConfig:
    """tp          tensor-parallel size (consecutive ranks); the rest of the world is data parallel
    engine      who trains: ``deepspeed`` (deepspeed.initialize, ZeRO stage ``zero_stage``, at any world
                size, one process too), ``torch`` (torch's AdamW in one process) or ``auto``: DeepSpeed
                where several processes run, where the ``deepspeed`` launcher started the job (one GPU
                then runs the cluster job's optimizer path) or where ``zero_stage`` was set by an
                override or by a YAML that names no engine; torch in a plain one-process run
                (fpscale.parallel.state.resolve_engine). The run's config.yaml records the engine that ran.
    zero_stage  DeepSpeed ZeRO stage (0-3) used when DeepSpeed trains
    timeout_s   bound on every collective: a rank that died makes the others fail with a message
    save_timeout_s  bound on the waits of a checkpoint save or resume check (its own gloo group);
                0 = derived from the model size (``checkpoint.save_timeout_s``)"""

    tp: int = 1
    engine: Literal["auto", "deepspeed", "torch"] = "auto"
    zero_stage: int = 1
    timeout_s: float = 300.0
    save_timeout_s: float = 0.0

    def validate(self, prefix: str = "parallel") -> None:
        check(self.tp >= 1, f"{prefix}.tp", f"must be >= 1, got {self.tp}")
        check(self.engine in ENGINES, f"{prefix}.engine", f"must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        check(self.zero_stage in (0, 1, 2, 3), f"{prefix}.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        check(self.timeout_s > 0, f"{prefix}.timeout_s", f"must be > 0, got {self.timeout_s}")
        check(self.save_timeout_s >= 0, f"{prefix}.save_timeout_s", f"must be >= 0 (0 = derived), got "
              f"{self.save_timeout_s}")
