"""The shard writer: encoded documents -> fpscale's token shards, one input unit at a time.

    w = ShardWriter("cache/corpus/tokens", dtype="uint16")
    w.done(3)                       # unit 3's record when it is complete on disk, else None
    w.write(3, [(is_val, ids), ...])  # tokens/shard_00003.{train,val}.{bin,idx} + shard_00003.json
    w.finish(meta)                  # tokens/metadata.json, written last: the folder is complete

Each document (its ids end with EOS) goes to the split its id hashes to (``is_validation``). A unit's
files are written atomically and its .json marker last, so an interrupted preparation continues at
the first unit without a marker and the shards come out byte-identical.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from fpscale.files import quick_digest, write_atomic

SPLITS = ("train", "val")


def is_validation(doc_id: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "little")
    return h < val_fraction * 2 ** 64


class ShardWriter:
    def __init__(self, tok_dir: str, dtype: str):
        self.dir, self.dtype = tok_dir, np.dtype(dtype)
        os.makedirs(tok_dir, exist_ok=True)

    def _base(self, unit: int) -> str:
        return os.path.join(self.dir, f"shard_{unit:05d}")

    def write(self, unit: int, encoded: list[tuple[bool, list[int]]]) -> dict:
        """Write unit ``unit``'s two splits and its commit marker; returns the marker's record."""
        record = {"unit": unit, "splits": {}}
        for split in SPLITS:
            docs = [np.asarray(ids, dtype=self.dtype) for is_val, ids in encoded if is_val == (split == "val")]
            tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=self.dtype)
            ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
            base = f"{self._base(unit)}.{split}"
            write_atomic(base + ".bin", tokens.tobytes())
            write_atomic(base + ".idx", ends.tobytes())
            record["splits"][split] = {"documents": len(docs), "tokens": int(tokens.size),
                                       "bytes": int(tokens.nbytes),
                                       "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
                                       "quick": quick_digest(base + ".bin")}
        write_atomic(self._base(unit) + ".json", json.dumps(record, indent=1).encode())
        return record

    def done(self, unit: int) -> dict | None:
        """The record of unit ``unit`` when its marker and files are complete, else None."""
        path = self._base(unit) + ".json"
        if not os.path.exists(path):
            return None
        with open(path) as fh:
            record = json.load(fh)
        for split, info in record["splits"].items():
            if os.path.getsize(f"{self._base(unit)}.{split}.bin") != info["bytes"]:
                return None
        return record

    def finish(self, header: dict, records: dict[int, dict]) -> dict:
        """metadata.json: ``header`` (plan, tokenizer) with the counts and the shard list."""
        counts = {s: {"documents": sum(r["splits"][s]["documents"] for r in records.values()),
                      "tokens": sum(r["splits"][s]["tokens"] for r in records.values())} for s in SPLITS}
        meta = {"format": "fpscale-token-shards-1", "complete": True, **header, "counts": counts,
                "shards": [{"unit": u, **{s: records[u]["splits"][s] for s in SPLITS}} for u in sorted(records)]}
        write_atomic(os.path.join(self.dir, "metadata.json"), json.dumps(meta, indent=1).encode())
        return meta
