"""Weighted blends of sources (prepared folders, Megatron indexed datasets) in one global order.

    data:
      blend:
        - {path: cache/fineweb_edu/tokens, weight: 0.5}
        - {path: cache/fineweb/tokens, weight: 0.3}
        - {path: /data/code_text_document, weight: 0.2, tokenizer: cache/fineweb/tokenizer.model}

The order, over global sample positions p = 0, 1, 2, ... (the ``consumed_samples`` counter):
  * Weights are normalised and fixed as integers W_s out of 2**30 (summing to exactly 2**30).
  * Positions come in blocks of ``BLOCK`` = 1024. Source s owns F_s(b) - F_{s-1}(b) of the positions
    before block b, where F_s(b) = floor(C_s * BLOCK * b / 2**30) and C_s = W_0 + ... + W_s; so block b
    holds n_s(b) = that count at b + 1 minus it at b (the counts of a block sum to BLOCK, and every
    prefix of whole blocks holds each source's share to within one sample).
  * Inside block b the n_s(b) slots of each source are shuffled by a generator seeded (seed, b).
  * The k-th slot of source s (k counts from the start of the stream) reads sample perm_{s,e}[k % N_s]
    of its own N_s samples, e = k // N_s, perm_{s,e} a permutation seeded (seed, s, e): a small
    source starts a new epoch (a new permutation) on its own, and the others never notice.
Every position is computed from (seed, p) alone, so a resume at ``consumed_samples`` continues the very
same stream on any DP size (fpscale/data/loader.py hands rank r its slice of each global batch), and
the fingerprint covers every source's fingerprint, name and weight.

Validation runs each source's own validation split (``val_loss_<name>``) and reports their
weight-averaged loss as ``val_loss`` (fpscale/train/validation.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache

import numpy as np
import torch

from fpscale.data.megatron import MegatronIndexed, is_megatron_prefix
from fpscale.data.shards import TokenShards
from fpscale.errors import ConfigError, DataError

BLOCK = 1024
UNIT = 1 << 30
_BLOCK_TAG, _EPOCH_TAG = 0xB1E0, 0xE90C       # keep the blend's generators apart from GlobalOrder's


def integer_weights(weights: list[float]) -> list[int]:
    """Normalised weights as integers out of 2**30 summing to exactly 2**30 (largest remainders)."""
    total = float(sum(weights))
    raw = [w / total * UNIT for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[:UNIT - sum(out)]:
        out[i] += 1
    return out


class BlendOrder:
    """Global position -> (source, sample) rows, as described in the module docstring."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        self.sizes, self.seed = list(sizes), seed
        self.cum = np.cumsum([0] + integer_weights(weights)).tolist()      # C_{s-1}, C_s as Python ints

    def _before(self, block: int) -> np.ndarray:
        """Slots of each source in the positions before ``block``."""
        f = [c * BLOCK * block // UNIT for c in self.cum]
        return np.diff(np.array(f, dtype=np.int64))

    @lru_cache(maxsize=8)
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position of the block, its slot number k within that source)."""
        base, counts = self._before(block), self._before(block + 1) - self._before(block)
        labels = np.random.default_rng([self.seed, _BLOCK_TAG, block]).permutation(
            np.repeat(np.arange(len(counts)), counts))
        slots = np.empty(BLOCK, dtype=np.int64)
        for s in range(len(counts)):
            where = labels == s
            slots[where] = base[s] + np.arange(int(where.sum()))
        return labels, slots

    @lru_cache(maxsize=16)
    def _perm(self, source: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, _EPOCH_TAG, source, epoch]).permutation(self.sizes[source])

    def indices(self, start: int, count: int) -> np.ndarray:
        """[count, 2] rows (source, sample) for global positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        out = np.empty((count, 2), dtype=np.int64)
        for b in np.unique(pos // BLOCK):
            sel = pos // BLOCK == b
            labels, slots = self._block(int(b))
            out[sel, 0], k = labels[pos[sel] % BLOCK], slots[pos[sel] % BLOCK]
            for s in np.unique(out[sel, 0]):
                mine = np.flatnonzero(sel)[out[sel, 0] == s]
                ks = k[out[sel, 0] == s]
                n = self.sizes[int(s)]
                out[mine, 1] = [self._perm(int(s), int(e))[o] for e, o in zip(ks // n, ks % n)]
        return out


class Blend:
    """The training split of several sources, read in :class:`BlendOrder`."""

    def __init__(self, sources: list, weights: list[float], names: list[str]):
        self.sources, self.weights, self.names = sources, list(weights), list(names)
        self.num_samples = sum(s.num_samples for s in sources)

    def order(self, seed: int) -> BlendOrder:
        return BlendOrder([s.num_samples for s in self.sources], self.weights, seed)

    def fingerprint(self) -> str:
        parts = [f"{n}:{w!r}:{s.fingerprint()}" for n, w, s in zip(self.names, self.weights, self.sources)]
        return hashlib.sha256(f"blend{BLOCK}|{'|'.join(parts)}".encode()).hexdigest()[:16]

    def batch(self, rows) -> torch.Tensor:
        rows = np.asarray(rows).reshape(-1, 2)
        return torch.from_numpy(np.stack([self.sources[int(s)].sample(int(i)) for s, i in rows]).astype(np.int64))


class BlendValidation:
    """The validation splits of a blend's sources, ``parts``: [(name, weight, dataset)]."""

    def __init__(self, sources: list, weights: list[float], names: list[str]):
        total = float(sum(weights))
        self.parts = [(n, w / total, s) for n, w, s in zip(names, weights, sources)]

    def fingerprint(self) -> str:
        return "|".join(f"{n}:{s.fingerprint()}" for n, _, s in self.parts)


# -- opening sources ---------------------------------------------------------------------------------

def shards_dir(path: str) -> str | None:
    """The folder holding metadata.json for a prepared ``path`` (the output folder or its tokens/)."""
    for folder in (path, os.path.join(path, "tokens")):
        if os.path.isfile(os.path.join(folder, "metadata.json")):
            return folder
    return None


def source_name(entry, i: int) -> str:
    """``entry.name``, else a name from its path (``fineweb`` for cache/fineweb/tokens), letters,
    digits, ``_``, ``-`` and ``.`` only: it names the metrics ``val_loss_<name>``."""
    if entry.name:
        return entry.name
    parts = [p for p in entry.path.rstrip("/").split("/") if p]
    stem = parts[-2] if len(parts) >= 2 and parts[-1] == "tokens" else (parts[-1] if parts else f"source{i}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)


def open_source(entry, split: str, seq_len: int):
    """One split of a blend entry: a prepared folder (TokenShards) or a Megatron prefix."""
    folder = shards_dir(entry.path)
    if folder is not None:
        return TokenShards(folder, split, seq_len)
    if is_megatron_prefix(entry.path):
        from fpscale.files import sha256_file
        return MegatronIndexed(entry.path, split, seq_len, entry.val_fraction,
                               sha256_file(entry.tokenizer) if entry.tokenizer else "")
    raise DataError(f"{entry.path}: neither a prepared folder (metadata.json in it or in its tokens/) nor a Megatron "
                    f"indexed dataset ({entry.path}.bin + .idx); run data/prepare_fineweb.py first")


def open_blend(data_cfg) -> tuple[Blend, BlendValidation]:
    """(train, validation) of ``data.blend``."""
    names = [source_name(e, i) for i, e in enumerate(data_cfg.blend)]
    weights = [e.weight for e in data_cfg.blend]
    train = [open_source(e, "train", data_cfg.seq_len) for e in data_cfg.blend]
    val = [open_source(e, "val", data_cfg.seq_len) for e in data_cfg.blend]
    return Blend(train, weights, names), BlendValidation(val, weights, names)


# -- what the config can check before any training ---------------------------------------------------

def tokenizer_of(path: str, tokenizer: str = "") -> dict | None:
    """{sha256, vocab_size, file} of the tokenizer a source was prepared with: a prepared folder's
    metadata.json (its file beside tokens/), or the ``tokenizer`` a Megatron entry names; None
    when the source is not there (the loader reports that when it opens it)."""
    folder = shards_dir(path)
    if folder is not None:
        with open(os.path.join(folder, "metadata.json")) as fh:
            meta = json.load(fh)
        file = meta.get("tokenizer", {}).get("file", "tokenizer.model")
        return {"sha256": meta["tokenizer_sha256"], "vocab_size": int(meta["vocab_size"]),
                "file": os.path.join(os.path.dirname(os.path.abspath(folder)), file)}
    if tokenizer and os.path.isfile(tokenizer):
        from fpscale.data.tokenizer import tokenizer_identity
        sha, vocab = tokenizer_identity(tokenizer)
        return {"sha256": sha, "vocab_size": vocab, "file": tokenizer}
    return None


def check_data(data_cfg, model_vocab: int) -> None:
    """Config-load checks of the data on disk: a Megatron entry names its tokenizer, every source
    shares one tokenizer, and ``model.vocab_size`` holds its vocabulary. Sources not on this machine
    are skipped (the loader names them when it opens them)."""
    entries = [(f"data.blend.{i}", e.path, e.tokenizer) for i, e in enumerate(data_cfg.blend)] or \
              [("data.path", data_cfg.path, "")]
    seen = None
    for key, path, tokenizer in entries:
        if is_megatron_prefix(path) and shards_dir(path) is None:
            if key == "data.path":
                raise ConfigError(key, f"{path} is a Megatron indexed dataset: give it as a data.blend entry "
                                       f"(with its tokenizer), e.g. data.blend=[{{path: {path}, weight: 1, "
                                       f"tokenizer: tokenizer.json}}]")
            if not tokenizer:
                raise ConfigError(f"{key}.tokenizer", f"{path} is a Megatron indexed dataset, which records no "
                                                      f"tokenizer: name the file it was tokenized with")
        tok = tokenizer_of(path, tokenizer)
        if tok is None:
            continue
        if seen is not None and tok["sha256"] != seen[1]["sha256"]:
            raise ConfigError(key, f"{path} was prepared with the tokenizer {tok['file']} (sha256 "
                                   f"{tok['sha256'][:16]}, {tok['vocab_size']} pieces), {seen[0]} ({seen[2]}) with "
                                   f"{seen[1]['file']} (sha256 {seen[1]['sha256'][:16]}, {seen[1]['vocab_size']} "
                                   f"pieces): a blend's sources must share one tokenizer")
        if tok["vocab_size"] > model_vocab:
            raise ConfigError("model.vocab_size", f"{model_vocab} is smaller than the {tok['vocab_size']} pieces of "
                                                  f"the tokenizer {path} was prepared with ({tok['file']}); set "
                                                  f"model.vocab_size >= {tok['vocab_size']}")
        seen = seen or (key, tok, path)


def data_tokenizer(data_cfg) -> str:
    """The tokenizer file of the config's data (the first source's): what the HF export and
    generation use by default."""
    entries = [(e.path, e.tokenizer) for e in data_cfg.blend] or [(data_cfg.path, "")]
    path, tokenizer = entries[0]
    tok = tokenizer_of(path, tokenizer)
    if tok is not None:
        return tok["file"]
    return tokenizer or os.path.join(os.path.dirname(str(path).rstrip("/")), "tokenizer.model")
