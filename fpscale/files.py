"""Files that must be trusted later: content hashes and atomic writes.

Shared by checkpoints (manifest hashes, meta.json) and the token shards (preparation and the
reader's checks), so that both hash and publish files the same way.
"""
from __future__ import annotations

import hashlib
import os


def sha256_file(path: str) -> str:
    """The sha256 of the whole file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def quick_digest(path: str, blocks: int = 16, block: int = 1 << 16) -> str:
    """sha256 over evenly spaced blocks of the file (the whole file when it is small)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        if size <= blocks * block:
            h.update(fh.read())
        else:
            for k in range(blocks):
                fh.seek((size - block) * k // (blocks - 1))
                h.update(fh.read(block))
    return h.hexdigest()


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never
    a part: written to a temporary file beside it, synced, then renamed over it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make the renames inside folder ``path`` durable (a rename is an entry of its folder)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
