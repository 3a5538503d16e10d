"""The document source: FineWeb streamed from the hub, or local files in its schema (.parquet,
.jsonl), as (id, text) pairs. Preparation (fpscale/data/prepare.py) reads documents only through
a source, encodes them with a tokenizer (tokenizer.py) and shards them with a writer (writer.py).

    src = FineWebSource(files=["cache/corpus/raw/*.parquet"])      # or FineWebSource(name="sample-10BT")
    for doc_id, text in src.documents(): ...
    src.fingerprint()        # files' names, sizes and hashes (or the hub config): what plan.json records
"""
from __future__ import annotations

import glob
import hashlib
import os
import socket
from typing import Iterator

from fpscale.errors import DataError
from fpscale.files import sha256_file

HUB_HOST = ("huggingface.co", 443)


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


class FineWebSource:
    """Documents of local files in FineWeb's schema, or of a FineWeb config on the hub."""

    def __init__(self, files: list[str] | None = None, name: str | None = None,
                 dataset: str = "HuggingFaceFW/fineweb", text_column: str = "text", skip_empty: bool = False):
        self.files = expand_files(files) if files else None
        self.name, self.dataset, self.text_column, self.skip_empty = name, dataset, text_column, skip_empty

    def documents(self) -> Iterator[tuple[str, str]]:
        """(id, text) per document, in the source's order (each call starts again)."""
        rows = open_documents(self.files, self.name, self.dataset, self.text_column)
        return iter_texts(rows, self.text_column, self.skip_empty)

    def fingerprint(self) -> str:
        return source_fingerprint(self.files, self.name, self.dataset)

    def describe(self) -> str:
        if not self.files:
            return f"{self.dataset} {self.name or ''}".strip()
        shown = ", ".join(os.path.basename(f) for f in self.files[:3])
        return shown + (f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")
