"""Preparation: a document source -> a tokenizer -> the shard writer, into one folder.

    python data/prepare_fineweb.py --name sample-10BT --out cache/fineweb --vocab-size 50304
    python data/prepare_fineweb.py --files 'cache/corpus/raw/*.parquet' --out cache/corpus
    python data/prepare_fineweb.py --files 'raw/*.parquet' --out cache/gpt2 --tokenizer gpt2/tokenizer.json

    prepare("cache/corpus", files=["cache/corpus/raw/*.parquet"], vocab_size=8000)   # the same, in Python

Output folder:
  tokenizer.model | tokenizer.json   SentencePiece BPE (trained on a sample, or the one passed in), or the
                         Hugging Face tokenizer passed in (copied)
  plan.json              the settings that fix the output (see ``Plan``); a re-run must match them
  tokens/shard_NNNNN.{train,val}.bin   token ids (uint16 when the vocabulary fits, else uint32),
                         each document followed by EOS
  tokens/shard_NNNNN.{train,val}.idx   int64 document end offsets into the .bin
  tokens/shard_NNNNN.json              commit marker of a unit: counts, sizes, checksums
  tokens/metadata.json   written last: tokenizer hash, kind, EOS and special tokens, counts, source
                         fingerprint, shards
Input unit k is documents [k*docs_per_shard, (k+1)*docs_per_shard) of the source; a document
goes to validation when the hash of its id falls below ``val_fraction``. Units are written
atomically and skipped on a re-run, so an interrupted preparation continues where it stopped
and produces byte-identical shards.

A re-run first compares its settings with the folder's plan.json (or, lacking it, the copy of the
plan in tokens/metadata.json) and refuses a folder prepared or started with other settings,
naming each difference; ``overwrite=True`` (``--overwrite``) deletes what preparation wrote there
(tokens/, plan.json, and the tokenizer files unless one is the tokenizer passed in) and prepares
afresh. The same settings on a complete folder return its metadata.

plan.json holds the fields of ``Plan``. ``skip_empty`` and ``tokenizer_sample_docs`` (null when
the tokenizer was passed in) were added to it later: a plan.json written without them is still
read, and a key it lacks is not compared.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, fields

from fpscale.data import tokenizer as tokenizers
from fpscale.data.fineweb import FineWebSource
from fpscale.data.writer import ShardWriter
from fpscale.errors import DataError
from fpscale.files import sha256_file, write_atomic

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.vocab", "tokenizer.json")


@dataclass
class Plan:
    """Everything that fixes the output bytes; a re-run or a resume must agree with it.

    ``vocab_size`` and ``dtype`` are the tokenizer's piece count and the dtype written;
    ``tokenizer_sample_docs`` is None when the tokenizer was passed in. A plan.json written before
    ``skip_empty`` and ``tokenizer_sample_docs`` existed lacks them; they are then not compared.
    """
    source: str
    vocab_size: int
    dtype: str
    val_fraction: float
    docs_per_shard: int
    tokenizer_sha256: str
    text_column: str
    skip_empty: bool
    tokenizer_sample_docs: int | None


# -- the folder: what it was prepared with ------------------------------------------------------------

def _recorded_plan(out_dir: str) -> dict | None:
    """The plan a folder was prepared (or started) with: plan.json, else metadata.json's copy."""
    keys = {f.name for f in fields(Plan)}
    for path in (os.path.join(out_dir, "plan.json"), os.path.join(out_dir, "tokens", "metadata.json")):
        if os.path.exists(path):
            with open(path) as fh:
                return {k: v for k, v in json.load(fh).items() if k in keys}
    return None


def _show(key: str, value) -> str:
    if value is None:
        return "none (tokenizer given)" if key == "tokenizer_sample_docs" else "none"
    if key == "tokenizer_sha256":
        return str(value)[:16]
    return repr(value) if isinstance(value, str) and key == "text_column" else str(value)


def _differences(recorded: dict, request: dict, source_desc: str = "") -> list[str]:
    """'key old there, new requested' for each key both hold with different values."""
    out = []
    for key, value in request.items():
        if key in recorded and recorded[key] != value:
            note = f" ({source_desc})" if key == "source" and source_desc else ""
            out.append(f"{key} {_show(key, recorded[key])} there, {_show(key, value)} requested{note}")
    return out


def _refusal(out_dir: str, differences: list[str]) -> DataError:
    state = "prepared" if os.path.exists(os.path.join(out_dir, "tokens", "metadata.json")) else "started"
    return DataError(f"{out_dir} was {state} with other settings: {'; '.join(differences)}; "
                     f"pass --overwrite to replace it, or use another --out")


def _same_file(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def remove_preparation(out_dir: str, keep: str | None = None) -> None:
    """Delete what preparing ``out_dir`` wrote: tokens/, plan.json, the tokenizer files
    (tokenizer.model, .vocab, .json) and the training sample a kill can leave. ``keep``, the
    tokenizer passed in, is never deleted; when it is tokenizer.model itself, tokenizer.vocab
    stays beside it."""
    keep_stat = os.stat(keep) if keep else None

    def remove(path: str) -> None:
        if not os.path.lexists(path):
            return
        if keep_stat is not None and os.path.exists(path) and os.path.samestat(os.stat(path), keep_stat):
            return
        if os.path.isdir(path) and not os.path.islink(path):
            for entry in os.listdir(path):
                remove(os.path.join(path, entry))
            if not os.listdir(path):
                os.rmdir(path)
        else:
            os.remove(path)

    names = ["tokens", "plan.json", "tokenizer.sample.txt", *TOKENIZER_FILES]
    if keep and _same_file(keep, os.path.join(out_dir, "tokenizer.model")):
        names.remove("tokenizer.vocab")
    for name in names:
        remove(os.path.join(out_dir, name))


# -- the tokenizer: given (copied into the folder), or trained on a sample ------------------------------

def _tokenizer(out_dir: str, source: FineWebSource, given: str | None, vocab_size: int, sample_docs: int,
               workers: int, eos_token: str | None, progress: bool):
    """The tokenizer of the folder, as a file inside it; given, trained now, or trained by the
    interrupted run this one continues."""
    if given:
        tok = tokenizers.load_tokenizer(given, eos_token)
        path = os.path.join(out_dir, tok.file_name)
        if not _same_file(given, path):
            with open(given, "rb") as src:
                write_atomic(path, src.read())
        return tokenizers.load_tokenizer(path, eos_token)
    path = os.path.join(out_dir, "tokenizer.model")
    if os.path.exists(path):
        n_pieces = tokenizers.load_tokenizer(path).vocab_size
        if n_pieces != vocab_size:
            raise DataError(f"{path} has {n_pieces} pieces, {vocab_size} requested; pass --overwrite to "
                            f"train a new one, --tokenizer {path} to use it, or use another --out")
        return tokenizers.load_tokenizer(path)
    sample = []
    for _, text in source.documents():
        sample.append(text)
        if len(sample) >= sample_docs:
            break
    t0 = time.time()
    tokenizers.train_tokenizer(sample, os.path.join(out_dir, "tokenizer"), vocab_size, workers)
    if progress:
        print(f"tokenizer: trained BPE with {vocab_size} pieces on {len(sample)} documents "
              f"in {time.time() - t0:.1f} s", flush=True)
    return tokenizers.load_tokenizer(path)


def _units(source: FineWebSource, docs_per_shard: int):
    """(unit index, [(id, text)]) in source order."""
    batch, unit = [], 0
    for doc in source.documents():
        batch.append(doc)
        if len(batch) == docs_per_shard:
            yield unit, batch
            batch, unit = [], unit + 1
    if batch:
        yield unit, batch


def prepare(out_dir: str, files: list[str] | None = None, name: str | None = None,
            dataset: str = "HuggingFaceFW/fineweb", tokenizer: str | None = None, vocab_size: int = 8000,
            dtype: str | None = None, val_fraction: float = 0.01, docs_per_shard: int = 4096,
            tokenizer_sample_docs: int = 20000, workers: int = 2, text_column: str = "text",
            skip_empty: bool = False, max_shards: int | None = None, progress: bool = True,
            overwrite: bool = False, eos_token: str | None = None) -> dict:
    """Prepare (or continue preparing) ``out_dir``; returns the metadata once complete.

    ``tokenizer``: a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` (its EOS:
    ``eos_token``, else the first usual one it holds); None trains a SentencePiece BPE of
    ``vocab_size`` pieces. A folder prepared or started with other settings is refused
    (``DataError`` naming each difference) unless ``overwrite``, which deletes what preparation
    wrote there and starts afresh. ``max_shards`` stops after that many units in total (the rest
    on a later call).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if docs_per_shard < 1 or workers < 1:
        raise DataError(f"docs_per_shard and workers must be >= 1, got {docs_per_shard}, {workers}")
    source = FineWebSource(files, name, dataset, text_column, skip_empty)
    given = tokenizers.load_tokenizer(tokenizer, eos_token) if tokenizer else None

    # 0. the folder: refuse one prepared with other settings, unless told to overwrite it
    request = {"source": source.fingerprint(), "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
               "text_column": text_column, "skip_empty": skip_empty}
    if given:
        request.update(tokenizer_sha256=sha256_file(tokenizer), dtype=tokenizers.token_dtype(given.vocab_size, dtype))
    else:
        request.update(vocab_size=vocab_size, dtype=tokenizers.token_dtype(vocab_size, dtype),
                       tokenizer_sample_docs=tokenizer_sample_docs)
    if overwrite:
        remove_preparation(out_dir, keep=tokenizer)
    recorded = _recorded_plan(out_dir)
    if recorded is not None:
        differences = _differences(recorded, request, source.describe())
        if differences:
            raise _refusal(out_dir, differences)
    writer = ShardWriter(os.path.join(out_dir, "tokens"), request["dtype"])
    meta_path = os.path.join(writer.dir, "metadata.json")
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            return json.load(fh)

    # 1. the tokenizer; 2. the plan: a resume must produce the same bytes. The settings were compared
    #    above; what only the tokenizer tells (a tokenizer.model replaced by hand) is compared here.
    tok = _tokenizer(out_dir, source, tokenizer, vocab_size, tokenizer_sample_docs, workers, eos_token, progress)
    plan = Plan(source=request["source"], vocab_size=tok.vocab_size,
                dtype=tokenizers.token_dtype(tok.vocab_size, dtype), val_fraction=val_fraction,
                docs_per_shard=docs_per_shard, tokenizer_sha256=sha256_file(tok.path),
                text_column=text_column, skip_empty=skip_empty,
                tokenizer_sample_docs=None if tokenizer else tokenizer_sample_docs)
    plan_path = os.path.join(out_dir, "plan.json")
    if os.path.exists(plan_path):
        with open(plan_path) as fh:
            recorded = json.load(fh)
        differences = _differences(recorded, {k: getattr(plan, k) for k in ("tokenizer_sha256", "vocab_size", "dtype")})
        if differences:
            raise _refusal(out_dir, differences)
    else:
        write_atomic(plan_path, json.dumps(asdict(plan), indent=1).encode())

    # 3. tokenize unit by unit in worker processes, skipping units already written
    records: dict[int, dict] = {}

    def pending():
        for unit, docs in _units(source, docs_per_shard):
            if max_shards is not None and unit >= max_shards:
                return
            done = writer.done(unit)
            if done is not None:
                records[unit] = done
                continue
            yield unit, docs, val_fraction

    from tqdm import tqdm
    bar = tqdm(disable=not progress, unit="doc", desc="tokenizing", dynamic_ncols=True)
    t0, n_tokens = time.time(), 0
    ctx = mp.get_context("fork") if hasattr(os, "fork") else mp.get_context()
    with ctx.Pool(workers, initializer=tokenizers._init_worker, initargs=(tok.path, eos_token)) as pool:
        for unit, encoded in pool.imap(tokenizers._encode_unit, pending(), chunksize=1):
            records[unit] = writer.write(unit, encoded)
            n_tokens += sum(len(ids) for _, ids in encoded)
            bar.update(len(encoded))
            bar.set_postfix(tokens_per_s=f"{n_tokens / max(time.time() - t0, 1e-9):,.0f}")
    bar.close()
    if max_shards is not None and len(records) >= max_shards and not _source_exhausted(source, docs_per_shard,
                                                                                         max_shards):
        return {"complete": False, "shards": len(records)}

    # 4. metadata, written last: its presence means "complete"
    header = {**asdict(plan), "eos_id": tok.eos_id, "tokenizer": tokenizers.tokenizer_record(tok)}
    return writer.finish(header, records)


def _source_exhausted(source: FineWebSource, docs_per_shard: int, max_shards: int) -> bool:
    for unit, _ in _units(source, docs_per_shard):
        if unit >= max_shards:
            return False
    return True
