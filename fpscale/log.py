"""fpscale's logging: one logger per module under ``fpscale``, each line prefixed with the rank
and the level.

    from fpscale.log import get_logger
    log = get_logger(__name__)
    log.info("saved checkpoint %s", path)     # [rank 0] INFO fpscale.train.checkpoint: saved checkpoint ...

Rank 0 logs from INFO up; the other ranks log warnings and errors only, so a 64-rank job prints
one progress line per event, not 64. ``FPSCALE_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) sets the
level, ``FPSCALE_LOG_ALL_RANKS=1`` lets every rank log at it. Lines go to stdout (a SLURM job's
``.out`` file), flushed at once. An application that configures the ``fpscale`` logger itself
keeps its own handlers: fpscale adds its handler only when the logger has none.
"""
from __future__ import annotations

import logging
import os
import sys

ROOT = "fpscale"


def rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank()
        if record.rank == 0 or os.environ.get("FPSCALE_LOG_ALL_RANKS") == "1":
            return True
        return record.levelno >= logging.WARNING


class _FlushingHandler(logging.StreamHandler):
    """Writes to the ``sys.stdout`` of the moment (pytest's capture included) and flushes."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not root.handlers:
        handler = _FlushingHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)d] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("FPSCALE_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (pass ``__name__``), under fpscale's configured root."""
    _configure()
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")
