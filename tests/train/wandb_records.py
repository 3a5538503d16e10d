"""Read back what a W&B run wrote offline (runs/<name>/wandb/offline-run-*/run-<id>.wandb): the
file is a LevelDB-style log (a 7-byte header ':W&B', 0xBEE1, version 0; then 32 KiB blocks of
records, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its
bytes) of wandb's protobuf ``Record`` messages. wandb 0.31 has no Python reader of its own."""
from __future__ import annotations

import glob
import json
import os
import struct

BLOCK, HEADER = 32768, 7


def records(path: str):
    """Every protobuf ``Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:                       # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            break
        parts.append(data[pos + HEADER:pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):                      # full, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def history(run_dir: str) -> tuple[dict[int, dict[str, float]], dict]:
    """({step: {tag: value}}, the run's config) of the one offline run under ``run_dir``/wandb."""
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    steps: dict[int, dict[str, float]] = {}
    config: dict = {}
    for r in records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            step = items.pop("_step")
            steps.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind in ("config", "run"):                 # the run record carries the config given to init
            update = (r.config if kind == "config" else r.run.config).update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update})
    return steps, config
