"""Preparation: round trip, counts, resumability, bad input."""
import filecmp
import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from fpscale.data.fineweb import DataError, is_validation, prepare, token_dtype
from fpscale.data.shards import TokenShards
from tests.data.conftest import make_docs, write_parquet


def read_docs(out, split):
    meta = json.load(open(os.path.join(out, "tokens", "metadata.json")))
    docs = []
    for shard in meta["shards"]:
        base = os.path.join(out, "tokens", f"shard_{shard['unit']:05d}.{split}")
        toks = np.fromfile(base + ".bin", dtype=meta["dtype"])
        ends = np.fromfile(base + ".idx", dtype=np.int64)
        docs += np.split(toks, ends[:-1]) if len(ends) else []
    return meta, docs


def test_round_trip_and_counts(prepared, corpus_file):
    import pyarrow.parquet as pq
    source = pq.read_table(corpus_file).to_pylist()
    sp = spm.SentencePieceProcessor(model_file=os.path.join(prepared, "tokenizer.model"))
    meta, train = read_docs(prepared, "train")
    _, val = read_docs(prepared, "val")
    want_val = [d for d in source if is_validation(d["id"], 0.2)]
    want_train = [d for d in source if not is_validation(d["id"], 0.2)]
    assert len(train) == len(want_train) and len(val) == len(want_val) and len(val) > 0
    for ids, doc in zip(train + val, want_train + want_val):
        assert ids[-1] == meta["eos_id"]
        assert sp.decode(ids[:-1].tolist()) == doc["text"]       # identity normalisation: exact
    for split, docs in (("train", train), ("val", val)):
        assert meta["counts"][split]["tokens"] == sum(len(d) for d in docs)
        assert meta["counts"][split]["documents"] == len(docs)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 320


def test_interrupted_preparation_resumes_byte_identical(tmp_path, corpus_file):
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    kw = dict(files=[corpus_file], vocab_size=320, val_fraction=0.2, docs_per_shard=16, workers=2, progress=False)
    prepare(str(fresh), **kw)
    partial = prepare(str(resumed), max_shards=3, **kw)
    assert partial == {"complete": False, "shards": 3}
    assert not os.path.exists(resumed / "tokens" / "metadata.json")
    # a crash in the middle of unit 2: its commit marker is gone and a temporary file is left
    os.remove(resumed / "tokens" / "shard_00002.json")
    (resumed / "tokens" / "shard_00002.train.bin.tmp").write_bytes(b"garbage")
    prepare(str(resumed), **kw)
    names = sorted(n for n in os.listdir(fresh / "tokens"))
    assert names == sorted(n for n in os.listdir(resumed / "tokens") if not n.endswith(".tmp"))
    for name in names:
        assert filecmp.cmp(fresh / "tokens" / name, resumed / "tokens" / name, shallow=False), name
    assert filecmp.cmp(fresh / "tokenizer.model", resumed / "tokenizer.model", shallow=False)


def test_resume_with_other_settings_is_refused(tmp_path, corpus_file):
    kw = dict(files=[corpus_file], vocab_size=320, docs_per_shard=16, workers=1, progress=False)
    prepare(str(tmp_path), max_shards=1, **kw)
    with pytest.raises(DataError, match="was started with other settings .*val_fraction"):
        prepare(str(tmp_path), val_fraction=0.5, **kw)


def test_jsonl_input_and_existing_tokenizer(tmp_path, prepared):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in make_docs(10, seed=5)))
    meta = prepare(str(tmp_path / "out"), files=[str(path)], tokenizer=os.path.join(prepared, "tokenizer.model"),
                   docs_per_shard=4, workers=1, progress=False)
    assert meta["complete"] and meta["counts"]["train"]["documents"] + meta["counts"]["val"]["documents"] == 10
    tokens_meta = json.load(open(os.path.join(prepared, "tokens", "metadata.json")))
    assert meta["tokenizer_sha256"] == tokens_meta["tokenizer_sha256"]


def test_bad_input_errors(tmp_path, prepared):
    tok = os.path.join(prepared, "tokenizer.model")
    with pytest.raises(DataError, match="no input file matches"):
        prepare(str(tmp_path / "a"), files=[str(tmp_path / "missing*.parquet")], progress=False)
    docs = make_docs(4)
    docs[2]["text"] = "   "
    bad = write_parquet(tmp_path / "empty.parquet", docs)
    with pytest.raises(DataError, match=r"document '<urn:test:2>' \(row 2\) is empty; pass --skip-empty"):
        prepare(str(tmp_path / "b"), files=[bad], tokenizer=tok, progress=False)
    meta = prepare(str(tmp_path / "b2"), files=[bad], tokenizer=tok, skip_empty=True, progress=False)
    assert meta["counts"]["train"]["documents"] + meta["counts"]["val"]["documents"] == 3
    rows = [{"text": 3, "id": "a"}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "num.parquet"))
    with pytest.raises(DataError, match=r"column 'text' must hold text; row 0 holds int"):
        prepare(str(tmp_path / "c"), files=[str(tmp_path / "num.parquet")], tokenizer=tok, progress=False)
    with pytest.raises(DataError, match=r"has no column 'content'"):
        prepare(str(tmp_path / "d"), files=[bad], tokenizer=tok, text_column="content", progress=False)
    with pytest.raises(DataError, match="70000 pieces, which do not fit uint16"):
        token_dtype(70000, "uint16")
    assert token_dtype(70000) == "uint32" and token_dtype(50304) == "uint16"


def test_hub_unreachable_fails_at_once(tmp_path, monkeypatch):
    import time

    from fpscale.data import fineweb
    monkeypatch.setattr(fineweb, "HUB_HOST", ("127.0.0.1", 9))     # nothing listens: refused at once
    t0 = time.time()
    with pytest.raises(DataError, match="cannot reach the Hugging Face hub"):
        prepare(str(tmp_path), name="sample-10BT", progress=False)
    assert time.time() - t0 < 10


def test_shard_fingerprint_mismatch_is_detected(tmp_path, prepared):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    TokenShards(str(copy / "tokens"), "train", 8)            # intact: opens
    victim = copy / "tokens" / "shard_00001.train.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard_00001.train.bin fails its checksum"):
        TokenShards(str(copy / "tokens"), "train", 8)
    victim.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="no longer matches its fingerprint"):
        TokenShards(str(copy / "tokens"), "train", 8)
    with pytest.raises(DataError, match="metadata.json missing"):
        TokenShards(str(tmp_path / "nothing"), "train", 8)
