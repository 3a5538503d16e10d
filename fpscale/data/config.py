"""Data section of the run config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fpscale.errors import check


@dataclass
class BlendSource:
    """One source of ``data.blend`` (fpscale/data/blend.py defines the order they are read in).

    path          a prepared folder (or its tokens/), or a Megatron indexed dataset's prefix (PREFIX.bin, .idx)
    weight        its share of the training samples (weights are normalised)
    name          names its validation metrics (val_loss_<name>); default: from the path
    tokenizer     Megatron prefixes: the tokenizer file its tokens come from (the .idx records none)
    val_fraction  Megatron prefixes: the last fraction of its documents held out for validation
    """

    path: str
    weight: float
    name: str = ""
    tokenizer: str = ""
    val_fraction: float = 0.01

    def validate(self, prefix: str = "") -> None:
        check(bool(self.path), f"{prefix}.path", "must name a prepared folder or a Megatron prefix")
        check(self.weight > 0, f"{prefix}.weight", f"must be > 0, got {self.weight}")
        check(0.0 <= self.val_fraction < 1.0, f"{prefix}.val_fraction", f"must lie in [0, 1), got {self.val_fraction}")


@dataclass
class DataConfig:
    """Where training samples come from.

    source     ``shards``: token shards written by data/prepare_fineweb.py (``path``), or the weighted
               ``blend`` of several sources when it is given; ``synthetic``: a generated task
               (``task``), for debugging and tests
    path       folder with metadata.json and the shard files
    blend      [{path, weight, ...}]: sources read in one weighted order (replaces ``path``)
    seq_len    tokens per sample (each sample holds seq_len + 1 tokens: inputs and targets)
    task       periodic (a random motif repeated: learnable by every layer type) | copy
    """

    source: Literal["shards", "synthetic"] = "shards"
    path: str = "cache/corpus/tokens"
    blend: list[BlendSource] = field(default_factory=list)
    seq_len: int = 256
    task: Literal["periodic", "copy"] = "periodic"
    period: int = 3

    def validate(self, prefix: str = "data") -> None:
        prefix = prefix or "data"
        check(self.seq_len >= 2, f"{prefix}.seq_len", f"must be >= 2, got {self.seq_len}")
        check(self.period >= 1, f"{prefix}.period", f"must be >= 1, got {self.period}")
        if self.blend:
            check(self.source == "shards", f"{prefix}.blend", f"needs data.source shards, got {self.source!r}")
            from fpscale.data.blend import source_name
            names = [source_name(e, i) for i, e in enumerate(self.blend)]
            for i, name in enumerate(names):
                check(name not in names[:i], f"{prefix}.blend.{i}.name",
                      f"{name!r} names two sources (entry {names.index(name)} and {i}): give each a distinct name")
