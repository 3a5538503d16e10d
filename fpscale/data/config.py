"""Data section of the run config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fpscale.errors import check


@dataclass
class DataConfig:
    """Where training samples come from.

    source     ``shards``: token shards written by data/prepare_fineweb.py (``path``);
               ``synthetic``: a generated task (``task``), for debugging and tests
    path       folder with metadata.json and the shard files
    seq_len    tokens per sample (each sample holds seq_len + 1 tokens: inputs and targets)
    task       periodic (a random motif repeated: learnable by every layer type) | copy
    """

    source: Literal["shards", "synthetic"] = "shards"
    path: str = "cache/corpus/tokens"
    seq_len: int = 256
    task: Literal["periodic", "copy"] = "periodic"
    period: int = 3

    def validate(self, prefix: str = "data") -> None:
        check(self.seq_len >= 2, f"{prefix}.seq_len", f"must be >= 2, got {self.seq_len}")
        check(self.period >= 1, f"{prefix}.period", f"must be >= 1, got {self.period}")
