"""Token shards on disk, read through numpy memmaps.

The split's shards form one token stream (documents end with EOS). Sample i is the window
tokens[i * seq_len : i * seq_len + seq_len + 1] (inputs and shifted targets), so
num_samples = (tokens - 1) // seq_len. Each shard is checked against the checksums recorded in
metadata.json when it is opened (sizes always; content by sampled blocks, or fully).
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from fpscale.errors import DataError
from fpscale.files import quick_digest, sha256_file


class TokenShards:
    def __init__(self, path: str, split: str, seq_len: int, verify: str = "quick"):
        meta_path = os.path.join(path, "metadata.json")
        if not os.path.exists(meta_path):
            raise DataError(f"no prepared token shards in {path} (metadata.json missing); run "
                            f"data/prepare_fineweb.py first (or the README's set-up command)")
        with open(meta_path) as fh:
            self.meta = json.load(fh)
        if split not in ("train", "val"):
            raise DataError(f"split must be train or val, got {split!r}")
        self.path, self.split, self.seq_len = path, split, seq_len
        self.dtype = np.dtype(self.meta["dtype"])
        self.arrays, starts = [], [0]
        for shard in self.meta["shards"]:
            info = shard[split]
            file = os.path.join(path, f"shard_{shard['unit']:05d}.{split}.bin")
            if not os.path.exists(file):
                raise DataError(f"shard file missing: {file}")
            if os.path.getsize(file) != info["bytes"]:
                raise DataError(f"shard {file} has {os.path.getsize(file)} bytes, metadata.json records "
                                f"{info['bytes']}: the shard no longer matches its fingerprint")
            if verify == "full" and sha256_file(file) != info["sha256"]:
                raise DataError(f"shard {file} fails its sha256 check: it no longer matches its fingerprint")
            if verify == "quick" and info.get("quick") and quick_digest(file) != info["quick"]:
                raise DataError(f"shard {file} fails its checksum: it no longer matches its fingerprint")
            if info["tokens"]:
                self.arrays.append(np.memmap(file, dtype=self.dtype, mode="r"))
                starts.append(starts[-1] + info["tokens"])
        self.starts = np.array(starts, dtype=np.int64)
        self.total_tokens = int(self.starts[-1])
        self.num_samples = max(0, (self.total_tokens - 1) // seq_len)
        if self.num_samples == 0:
            raise DataError(f"the {split} split of {path} holds {self.total_tokens} tokens, fewer than one "
                            f"sample of seq_len + 1 = {seq_len + 1}")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_vocab(self, model_vocab: int) -> None:
        if self.vocab_size > model_vocab:
            raise DataError(f"the tokenizer of {self.path} has {self.vocab_size} pieces but model.vocab_size "
                            f"is {model_vocab}; set model.vocab_size >= {self.vocab_size}")

    def fingerprint(self) -> str:
        shas = "".join(s[self.split]["sha256"] for s in self.meta["shards"])
        return hashlib.sha256(f"{self.meta['tokenizer_sha256']}|{self.split}|{self.seq_len}|{shas}"
                              .encode()).hexdigest()[:16]

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the stream from ``start`` (may cross shards)."""
        parts = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while count > 0:
            arr = self.arrays[k]
            off = start - int(self.starts[k])
            take = min(count, len(arr) - off)
            parts.append(arr[off:off + take])
            start, count, k = start + take, count - take, k + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def sample(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        return self.tokens(index * self.seq_len, self.seq_len + 1)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]).astype(np.int64))
