"""Megatron-LM's indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, written by its
tools/preprocess_data.py or megatron-core's ``IndexedDatasetBuilder``), read in place.

    ds = MegatronIndexed("data/web_text_document", "train", seq_len=1024, val_fraction=0.01)
    ds.sample(0)          # seq_len + 1 tokens, like TokenShards.sample

The .idx (version 1, little-endian) holds: the 9-byte magic ``MMIDIDX\\0\\0``, the version (u64), the
dtype code of the .bin (u8: 8 uint16, 4 int32 are what the builder writes; 1 uint8, 2 int8, 3 int16,
5 int64 are read too), the sequence count S and the document-index count D (u64 each), then S int32
sequence lengths, S int64 byte pointers into the .bin, and D int64 document indices (document j
is sequences [doc[j], doc[j+1]); doc[0] = 0). The tokens are read as one stream through a memmap of
the .bin, packed into samples exactly as fpscale's shards are (sample i is
``tokens[i * seq_len : i * seq_len + seq_len + 1]``); EOS is whatever the preprocessing appended
(Megatron's ``--append-eod``). The last ``val_fraction`` of the documents (at least one when it is
above 0) is the validation split, the rest training: Megatron's ``--split`` keeps the same order.
"""
from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
import torch

from fpscale.errors import DataError
from fpscale.files import quick_digest

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}   # Megatron's DType codes
UNREADABLE = {6: "float64", 7: "float32"}


def is_megatron_prefix(path: str) -> bool:
    return os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")


def read_index(idx_path: str) -> dict:
    """The header and arrays of a .idx file (``lengths``, ``pointers``, ``documents``, ``dtype``)."""
    with open(idx_path, "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != MAGIC:
        raise DataError(f"{idx_path} is not a Megatron indexed dataset index (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DataError(f"{idx_path}: Megatron index version {version}; fpscale reads version 1")
    if code not in DTYPES:
        name = UNREADABLE.get(code, f"unknown code {code}")
        raise DataError(f"{idx_path}: token dtype {name} (code {code}); fpscale reads the integer dtypes "
                        f"{', '.join(np.dtype(t).name for t in DTYPES.values())}")
    need = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
    if os.path.getsize(idx_path) < need:
        raise DataError(f"{idx_path} is truncated: {os.path.getsize(idx_path)} bytes, its header needs {need}")
    buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buf, np.int32, n_seq, 34)
    pointers = np.frombuffer(buf, np.int64, n_seq, 34 + 4 * n_seq)
    documents = np.frombuffer(buf, np.int64, n_doc, 34 + 12 * n_seq)
    return {"dtype": np.dtype(DTYPES[code]), "lengths": lengths, "pointers": pointers, "documents": documents}


class MegatronIndexed:
    """One split of a Megatron dataset as a token stream of ``seq_len + 1``-token samples."""

    def __init__(self, prefix: str, split: str, seq_len: int, val_fraction: float = 0.01,
                 tokenizer_sha256: str = ""):
        if not is_megatron_prefix(prefix):
            raise DataError(f"no Megatron indexed dataset at {prefix} ({prefix}.bin and {prefix}.idx)")
        if split not in ("train", "val"):
            raise DataError(f"split must be train or val, got {split!r}")
        index = read_index(prefix + ".idx")
        self.path, self.split, self.seq_len, self.dtype = prefix, split, seq_len, index["dtype"]
        lengths, pointers, docs = index["lengths"], index["pointers"], index["documents"]
        item = self.dtype.itemsize
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])       # token offset of each sequence
        if not np.array_equal(pointers, starts[:-1] * item):
            raise DataError(f"{prefix}.idx: the sequences are not stored one after another in the .bin; fpscale "
                            f"reads a .bin written in order (as IndexedDatasetBuilder writes it)")
        size = os.path.getsize(prefix + ".bin")
        if size != starts[-1] * item:
            raise DataError(f"{prefix}.bin has {size} bytes, its .idx records {starts[-1] * item}")
        if len(docs) < 2 or docs[0] != 0 or np.any(np.diff(docs) < 0) or docs[-1] > len(lengths):
            raise DataError(f"{prefix}.idx: its document indices are not an increasing list of sequence indices")
        self.doc_ends = starts[docs[1:]]                          # token offset where each document ends
        n_docs = len(self.doc_ends)
        n_val = 0 if val_fraction <= 0 else max(1, int(round(val_fraction * n_docs)))
        if n_val >= n_docs:
            raise DataError(f"{prefix}: val_fraction {val_fraction} leaves no training document of {n_docs}")
        cut = int(starts[docs[n_docs - n_val]])                   # first token of the first validation document
        self.begin, self.end = (0, cut) if split == "train" else (cut, int(starts[docs[-1]]))
        self.documents = n_docs - n_val if split == "train" else n_val
        self.stream = np.memmap(prefix + ".bin", dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)
        self.total_tokens = self.end - self.begin
        self.num_samples = max(0, (self.total_tokens - 1) // seq_len)
        if self.num_samples == 0:
            raise DataError(f"the {split} split of {prefix} holds {self.total_tokens} tokens, fewer than one "
                            f"sample of seq_len + 1 = {seq_len + 1}")
        digest = f"{quick_digest(prefix + '.idx')}|{quick_digest(prefix + '.bin')}"
        self._fingerprint = hashlib.sha256(f"megatron|{tokenizer_sha256}|{split}|{seq_len}|{val_fraction}|{digest}"
                                           .encode()).hexdigest()[:16]

    def fingerprint(self) -> str:
        return self._fingerprint

    def sample(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = self.begin + index * self.seq_len
        return np.asarray(self.stream[start:start + self.seq_len + 1])

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]).astype(np.int64))
