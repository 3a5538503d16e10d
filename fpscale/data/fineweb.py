"""FineWeb (or local files in its schema) -> SentencePiece tokenizer -> token shards.

    python data/prepare_fineweb.py --name sample-10BT --out cache/fineweb --vocab-size 50304
    python data/prepare_fineweb.py --files 'cache/corpus/raw/*.parquet' --out cache/corpus

Output folder:
  tokenizer.model        SentencePiece BPE (trained on a sample, or the one passed in)
  plan.json              the settings that fix the output (see ``Plan``); a re-run must match them
  tokens/shard_NNNNN.{train,val}.bin   token ids (uint16 when the vocabulary fits, else uint32),
                         each document followed by EOS
  tokens/shard_NNNNN.{train,val}.idx   int64 document end offsets into the .bin
  tokens/shard_NNNNN.json              commit marker of a unit: counts, sizes, checksums
  tokens/metadata.json   written last: tokenizer hash, counts, source fingerprint, shards
Input unit k is documents [k*docs_per_shard, (k+1)*docs_per_shard) of the source; a document
goes to validation when the hash of its id falls below ``val_fraction``. Units are written
atomically and skipped on a re-run, so an interrupted preparation continues where it stopped
and produces byte-identical shards.

A re-run first compares its settings with the folder's plan.json (or, lacking it, the copy of the
plan in tokens/metadata.json) and refuses a folder prepared or started with other settings,
naming each difference; ``overwrite=True`` (``--overwrite``) deletes what preparation wrote there
(tokens/, plan.json, and tokenizer.model/.vocab unless tokenizer.model is the tokenizer passed
in) and prepares afresh. The same settings on a complete folder return its metadata.

plan.json holds the fields of ``Plan``. ``skip_empty`` and ``tokenizer_sample_docs`` (null when
the tokenizer was passed in) were added to it later: a plan.json written without them is still
read, and a key it lacks is not compared.
"""
from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing as mp
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from typing import Iterator

import numpy as np

from fpscale.errors import DataError
from fpscale.files import quick_digest, sha256_file, write_atomic

HUB_HOST = ("huggingface.co", 443)


# -- reading documents --------------------------------------------------------------------------
def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def _import_datasets(offline: bool):
    """Import ``datasets``; offline flags must be set before the import to take effect."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    return datasets


def expand_files(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise DataError(f"no input file matches {pattern!r}")
        files += matched
    for f in files:
        if not f.endswith((".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            raise DataError(f"{f}: unsupported file type (use .parquet or .jsonl)")
    return files


def open_documents(files: list[str] | None = None, name: str | None = None,
                   dataset: str = "HuggingFaceFW/fineweb", text_column: str = "text"):
    """A streaming ``datasets`` iterable of FineWeb-schema rows, from local files or the hub."""
    if files:
        datasets = _import_datasets(offline=True)
        kind = "parquet" if files[0].endswith(".parquet") else "json"
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
    if not hub_reachable():
        raise DataError(f"cannot reach the Hugging Face hub ({HUB_HOST[0]}:{HUB_HOST[1]}) to stream "
                        f"{dataset} {name or ''}; download the parquet files elsewhere and pass --files")
    datasets = _import_datasets(offline=False)
    return datasets.load_dataset(dataset, name=name, split="train", streaming=True)


def iter_texts(rows, text_column: str, skip_empty: bool) -> Iterator[tuple[str, str]]:
    """(id, text) per document, with the checks that give clear errors."""
    n = 0
    for row_index, row in enumerate(rows):
        if text_column not in row:
            raise DataError(f"the input has no column {text_column!r} (columns: {', '.join(row)})")
        text = row[text_column]
        if not isinstance(text, str):
            raise DataError(f"column {text_column!r} must hold text; row {row_index} holds "
                            f"{type(text).__name__} ({str(text)[:40]!r})")
        doc_id = str(row.get("id") or row_index)
        if not text.strip():
            if skip_empty:
                continue
            raise DataError(f"document {doc_id!r} (row {row_index}) is empty; pass --skip-empty to drop "
                            f"empty documents")
        n += 1
        yield doc_id, text
    if n == 0:
        raise DataError("the input holds no non-empty document")


def source_fingerprint(files: list[str] | None, name: str | None, dataset: str) -> str:
    if files:
        parts = [f"{os.path.basename(f)}:{os.path.getsize(f)}:{sha256_file(f)[:16]}" for f in files]
    else:
        parts = [dataset, name or ""]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


# -- the tokenizer --------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], prefix: str, vocab_size: int, threads: int = 2) -> str:
    """SentencePiece BPE with byte fallback and identity normalisation: decode(encode(t)) == t.

    SentencePiece records its input and output paths inside the model file; training runs in
    the output folder with relative names so the file depends only on the data and settings.
    """
    import sentencepiece as spm

    folder, name = os.path.split(os.path.abspath(prefix))
    sample = f"{name}.sample.txt"
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with open(sample, "w", encoding="utf-8") as fh:
            for text in texts:
                fh.write(text.replace("\r", "") + "\n")
        spm.SentencePieceTrainer.train(
            input=sample, model_prefix=name, vocab_size=vocab_size, model_type="bpe",
            character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
            num_threads=threads, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=16384, train_extremely_large_corpus=False)
    finally:
        if os.path.exists(sample):
            os.unlink(sample)
        os.chdir(cwd)
    return prefix + ".model"


def token_dtype(n_vocab: int, requested: str | None = None) -> str:
    """uint16 when the vocabulary fits, else uint32; a requested dtype must hold every id."""
    fits16 = n_vocab <= 2 ** 16
    dtype = requested or ("uint16" if fits16 else "uint32")
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"dtype must be uint16 or uint32, got {dtype!r}")
    if dtype == "uint16" and not fits16:
        raise DataError(f"the tokenizer has {n_vocab} pieces, which do not fit uint16 (at most 65536); use uint32")
    return dtype


# -- parallel tokenization -------------------------------------------------------------------------

_SP = None


def _init_worker(model_path: str) -> None:
    global _SP
    import sentencepiece as spm
    _SP = spm.SentencePieceProcessor(model_file=model_path)


def _encode_unit(args):
    """Tokenize one unit: returns (unit index, [(is_val, ids)], docs)."""
    unit, docs, val_fraction = args
    ids = _SP.encode([text for _, text in docs])
    eos = _SP.eos_id()
    return unit, [(is_validation(doc_id, val_fraction), tok + [eos]) for (doc_id, _), tok in zip(docs, ids)]


def is_validation(doc_id: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "little")
    return h < val_fraction * 2 ** 64


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


def _describe_source(files: list[str] | None, name: str | None, dataset: str) -> str:
    if not files:
        return f"{dataset} {name or ''}".strip()
    shown = ", ".join(os.path.basename(f) for f in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _same_file(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def remove_preparation(out_dir: str, keep: str | None = None) -> None:
    """Delete what preparing ``out_dir`` wrote: tokens/, plan.json, tokenizer.model and
    tokenizer.vocab (and the training sample a kill can leave). ``keep``, the tokenizer passed in,
    is never deleted; when it is tokenizer.model itself, tokenizer.vocab stays beside it."""
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

    names = ["tokens", "plan.json", "tokenizer.sample.txt", "tokenizer.model"]
    if not (keep and _same_file(keep, os.path.join(out_dir, "tokenizer.model"))):
        names.append("tokenizer.vocab")
    for name in names:
        remove(os.path.join(out_dir, name))


def _write_unit(tok_dir: str, unit: int, encoded, dtype) -> dict:
    record = {"unit": unit, "splits": {}}
    for split, want_val in (("train", False), ("val", True)):
        docs = [np.asarray(ids, dtype=dtype) for is_val, ids in encoded if is_val == want_val]
        tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=dtype)
        ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
        base = os.path.join(tok_dir, f"shard_{unit:05d}.{split}")
        write_atomic(base + ".bin", tokens.tobytes())
        write_atomic(base + ".idx", ends.tobytes())
        record["splits"][split] = {"documents": len(docs), "tokens": int(tokens.size), "bytes": int(tokens.nbytes),
                                   "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
                                   "quick": quick_digest(base + ".bin")}
    write_atomic(os.path.join(tok_dir, f"shard_{unit:05d}.json"), json.dumps(record, indent=1).encode())
    return record


def _unit_done(tok_dir: str, unit: int) -> dict | None:
    path = os.path.join(tok_dir, f"shard_{unit:05d}.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        record = json.load(fh)
    for split, info in record["splits"].items():
        if os.path.getsize(os.path.join(tok_dir, f"shard_{unit:05d}.{split}.bin")) != info["bytes"]:
            return None
    return record


def prepare(out_dir: str, files: list[str] | None = None, name: str | None = None,
            dataset: str = "HuggingFaceFW/fineweb", tokenizer: str | None = None, vocab_size: int = 8000,
            dtype: str | None = None, val_fraction: float = 0.01, docs_per_shard: int = 4096,
            tokenizer_sample_docs: int = 20000, workers: int = 2, text_column: str = "text",
            skip_empty: bool = False, max_shards: int | None = None, progress: bool = True,
            overwrite: bool = False) -> dict:
    """Prepare (or continue preparing) ``out_dir``; returns the metadata once complete.

    A folder prepared or started with other settings is refused (``DataError`` naming each
    difference) unless ``overwrite``, which deletes what preparation wrote there and starts
    afresh. ``max_shards`` stops after that many units in total (the rest on a later call).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if docs_per_shard < 1 or workers < 1:
        raise DataError(f"docs_per_shard and workers must be >= 1, got {docs_per_shard}, {workers}")
    if files:
        files = expand_files(files)
    if tokenizer and not os.path.exists(tokenizer):
        raise DataError(f"tokenizer not found: {tokenizer}")
    import sentencepiece as spm
    fingerprint = source_fingerprint(files, name, dataset)

    # 0. the folder: refuse one prepared with other settings, unless told to overwrite it
    request = {"source": fingerprint, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
               "text_column": text_column, "skip_empty": skip_empty}
    if tokenizer:
        request["tokenizer_sha256"] = sha256_file(tokenizer)
        request["dtype"] = token_dtype(spm.SentencePieceProcessor(model_file=tokenizer).get_piece_size(), dtype)
    else:
        request.update(vocab_size=vocab_size, dtype=token_dtype(vocab_size, dtype),
                       tokenizer_sample_docs=tokenizer_sample_docs)
    if overwrite:
        remove_preparation(out_dir, keep=tokenizer)
    recorded = _recorded_plan(out_dir)
    if recorded is not None:
        differences = _differences(recorded, request, _describe_source(files, name, dataset))
        if differences:
            raise _refusal(out_dir, differences)
    tok_dir = os.path.join(out_dir, "tokens")
    os.makedirs(tok_dir, exist_ok=True)
    meta_path = os.path.join(tok_dir, "metadata.json")
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            return json.load(fh)

    def rows():
        return open_documents(files, name, dataset, text_column)

    # 1. the tokenizer: given, or trained on a sample of the documents (or trained by the
    #    interrupted run this one continues)
    model_path = os.path.join(out_dir, "tokenizer.model")
    if tokenizer:
        if os.path.abspath(tokenizer) != os.path.abspath(model_path):
            with open(tokenizer, "rb") as src:
                write_atomic(model_path, src.read())
    elif os.path.exists(model_path):
        n_pieces = spm.SentencePieceProcessor(model_file=model_path).get_piece_size()
        if n_pieces != vocab_size:
            raise DataError(f"{model_path} has {n_pieces} pieces, {vocab_size} requested; pass --overwrite to "
                            f"train a new one, --tokenizer {model_path} to use it, or use another --out")
    else:
        sample = []
        for _, text in iter_texts(rows(), text_column, skip_empty):
            sample.append(text)
            if len(sample) >= tokenizer_sample_docs:
                break
        t0 = time.time()
        train_tokenizer(sample, os.path.join(out_dir, "tokenizer"), vocab_size, workers)
        if progress:
            print(f"tokenizer: trained BPE with {vocab_size} pieces on {len(sample)} documents "
                  f"in {time.time() - t0:.1f} s", flush=True)
    sp = spm.SentencePieceProcessor(model_file=model_path)
    n_vocab = sp.get_piece_size()
    dtype = token_dtype(n_vocab, dtype)

    # 2. the plan: a resume must produce the same bytes. The settings were compared above; what
    #    only the tokenizer tells (a tokenizer.model replaced by hand) is compared here.
    plan = Plan(source=fingerprint, vocab_size=n_vocab, dtype=dtype, val_fraction=val_fraction,
                docs_per_shard=docs_per_shard, tokenizer_sha256=sha256_file(model_path), text_column=text_column,
                skip_empty=skip_empty, tokenizer_sample_docs=None if tokenizer else tokenizer_sample_docs)
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
    def units():
        batch, unit = [], 0
        for doc in iter_texts(rows(), text_column, skip_empty):
            batch.append(doc)
            if len(batch) == docs_per_shard:
                yield unit, batch
                batch, unit = [], unit + 1
        if batch:
            yield unit, batch

    records: dict[int, dict] = {}

    def pending():
        for unit, docs in units():
            if max_shards is not None and unit >= max_shards:
                return
            done = _unit_done(tok_dir, unit)
            if done is not None:
                records[unit] = done
                continue
            yield unit, docs, val_fraction

    from tqdm import tqdm
    bar = tqdm(disable=not progress, unit="doc", desc="tokenizing", dynamic_ncols=True)
    t0, n_tokens = time.time(), 0
    ctx = mp.get_context("fork") if hasattr(os, "fork") else mp.get_context()
    with ctx.Pool(workers, initializer=_init_worker, initargs=(model_path,)) as pool:
        for unit, encoded in pool.imap(_encode_unit, pending(), chunksize=1):
            records[unit] = _write_unit(tok_dir, unit, encoded, np.dtype(dtype))
            n_tokens += sum(len(ids) for _, ids in encoded)
            bar.update(len(encoded))
            bar.set_postfix(tokens_per_s=f"{n_tokens / max(time.time() - t0, 1e-9):,.0f}")
    bar.close()
    n_units = len(records)
    if max_shards is not None and n_units >= max_shards and not _source_exhausted(units, max_shards):
        return {"complete": False, "shards": n_units}

    # 4. metadata, written last: its presence means "complete"
    counts = {s: {"documents": sum(r["splits"][s]["documents"] for r in records.values()),
                  "tokens": sum(r["splits"][s]["tokens"] for r in records.values())} for s in ("train", "val")}
    meta = {"format": "fpscale-token-shards-1", "complete": True, **asdict(plan), "eos_id": sp.eos_id(),
            "counts": counts,
            "shards": [{"unit": u, **{s: records[u]["splits"][s] for s in ("train", "val")}} for u in sorted(records)]}
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    return meta


def _source_exhausted(units, max_shards: int) -> bool:
    for unit, _ in units():
        if unit >= max_shards:
            return False
    return True
