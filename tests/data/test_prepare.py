"""Preparation: round trip, counts, resumability, bad input."""
import filecmp
import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from fpscale.data.prepare import DataError, prepare
from fpscale.data.shards import TokenShards
from fpscale.data.tokenizer import token_dtype
from fpscale.data.writer import is_validation
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
    with pytest.raises(DataError, match="was started with other settings: .*val_fraction 0.01 there, 0.5 requested"):
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



# -- a re-run into a folder that exists (issue 18) -------------------------------------------------

PREPARED = dict(vocab_size=320, val_fraction=0.2, docs_per_shard=16, workers=2, progress=False)   # as conftest's


def copy_of(prepared, tmp_path):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    return str(out)


def snapshot(folder):
    """{relative path: (bytes, mtime)} of every file under ``folder``."""
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            out[os.path.relpath(path, folder)] = (open(path, "rb").read(), os.stat(path).st_mtime_ns)
    return out


def test_complete_folder_with_other_settings_is_refused(tmp_path, prepared, corpus_file):
    out = copy_of(prepared, tmp_path)
    before = snapshot(out)
    with pytest.raises(DataError, match=r"out was prepared with other settings: vocab_size 320 there, 400 requested; "
                                        r"pass --overwrite to replace it, or use another --out$"):
        prepare(out, files=[corpus_file], **{**PREPARED, "vocab_size": 400})
    with pytest.raises(DataError, match=r"settings: val_fraction 0.2 there, 0.1 requested; skip_empty False there, "
                                        r"True requested; tokenizer_sample_docs 20000 there, 50 requested; pass"):
        prepare(out, files=[corpus_file], **{**PREPARED, "val_fraction": 0.1}, skip_empty=True,
                tokenizer_sample_docs=50)
    with pytest.raises(DataError, match=r"settings: dtype uint16 there, uint32 requested; pass"):
        prepare(out, files=[corpus_file], dtype="uint32", **PREPARED)
    assert snapshot(out) == before


def test_other_files_or_tokenizer_are_refused(tmp_path, prepared, corpus_file):
    from fpscale.data.tokenizer import train_tokenizer
    out = copy_of(prepared, tmp_path)
    other = write_parquet(tmp_path / "other.parquet", make_docs(30, seed=3))
    with pytest.raises(DataError, match=r"out was prepared with other settings: source [0-9a-f]{16} there, "
                                        r"[0-9a-f]{16} requested \(other.parquet\); pass --overwrite"):
        prepare(out, files=[other], **PREPARED)
    other_tok = train_tokenizer([d["text"] for d in make_docs(60, seed=4)], str(tmp_path / "other"), 400, 1)
    with pytest.raises(DataError, match=r"settings: tokenizer_sha256 [0-9a-f]{16} there, [0-9a-f]{16} requested; pass"):
        prepare(out, files=[corpus_file], tokenizer=other_tok, **PREPARED)
    # the folder's own tokenizer passed in is the same tokenizer: accepted
    same = prepare(out, files=[corpus_file], tokenizer=os.path.join(out, "tokenizer.model"), **PREPARED)
    assert same == json.load(open(os.path.join(out, "tokens", "metadata.json")))


def test_partial_folder_with_other_settings_is_refused(tmp_path, corpus_file):
    kw = dict(files=[corpus_file], vocab_size=320, docs_per_shard=16, workers=1, progress=False)
    prepare(str(tmp_path), max_shards=1, **kw)
    # the old code reused the 320-piece tokenizer.model and resumed
    with pytest.raises(DataError, match="was started with other settings: vocab_size 320 there, 400 requested"):
        prepare(str(tmp_path), **{**kw, "vocab_size": 400})
    with pytest.raises(DataError, match="was started with other settings: skip_empty False there, True requested"):
        prepare(str(tmp_path), skip_empty=True, **kw)
    assert prepare(str(tmp_path), **kw)["complete"]                     # the same settings resume


def test_same_command_returns_the_metadata_without_tokenizing(tmp_path, prepared, corpus_file, monkeypatch):
    from fpscale.data import fineweb, tokenizer
    out = copy_of(prepared, tmp_path)
    before = snapshot(out)

    def unused(*args, **kwargs):
        raise AssertionError("a complete folder was prepared again")
    monkeypatch.setattr(fineweb, "open_documents", unused)
    monkeypatch.setattr(tokenizer, "train_tokenizer", unused)
    meta = prepare(out, files=[corpus_file], **PREPARED)
    assert meta == json.load(open(os.path.join(prepared, "tokens", "metadata.json"))) and meta["complete"]
    assert snapshot(out) == before


def test_old_plan_without_the_new_keys_is_read(tmp_path, prepared, corpus_file):
    """A folder prepared before skip_empty / tokenizer_sample_docs were recorded (cache/corpus)."""
    out = copy_of(prepared, tmp_path)
    for name in ("plan.json", os.path.join("tokens", "metadata.json")):
        path = os.path.join(out, name)
        data = json.load(open(path))
        del data["skip_empty"], data["tokenizer_sample_docs"]
        open(path, "w").write(json.dumps(data, indent=1))
    assert prepare(out, files=[corpus_file], skip_empty=True, tokenizer_sample_docs=50, **PREPARED)["complete"]
    with pytest.raises(DataError, match="vocab_size 320 there, 400 requested"):
        prepare(out, files=[corpus_file], **{**PREPARED, "vocab_size": 400})


def test_overwrite_replaces_the_preparation(tmp_path, prepared, corpus_file):
    out = copy_of(prepared, tmp_path)
    open(os.path.join(out, "notes.txt"), "w").write("mine")
    meta = prepare(out, files=[corpus_file], overwrite=True, **{**PREPARED, "vocab_size": 400, "docs_per_shard": 32})
    assert meta["complete"] and meta["vocab_size"] == 400 and len(meta["shards"]) == 4
    assert spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model")).get_piece_size() == 400
    assert json.load(open(os.path.join(out, "plan.json")))["vocab_size"] == 400
    assert sorted(os.listdir(os.path.join(out, "tokens"))) == sorted(
        ["metadata.json"] + [f"shard_{u:05d}.{x}" for u in range(4) for x in ("json", "train.bin", "train.idx",
                                                                          "val.bin", "val.idx")])
    assert open(os.path.join(out, "notes.txt")).read() == "mine"          # nothing else is deleted
    assert prepare(out, files=[corpus_file], **{**PREPARED, "vocab_size": 400, "docs_per_shard": 32}) == meta


def test_overwrite_keeps_a_given_tokenizer_inside_the_folder(tmp_path, prepared, corpus_file):
    out = copy_of(prepared, tmp_path)
    model = os.path.join(out, "tokenizer.model")
    model_bytes = open(model, "rb").read()
    meta = prepare(out, files=[corpus_file], tokenizer=model, overwrite=True, **{**PREPARED, "docs_per_shard": 8})
    assert open(model, "rb").read() == model_bytes and os.path.exists(os.path.join(out, "tokenizer.vocab"))
    assert meta["complete"] and meta["docs_per_shard"] == 8 and meta["tokenizer_sample_docs"] is None
    # a tokenizer kept under tokens/ survives too, and the folder's tokenizer.model is replaced by it
    inner = os.path.join(out, "tokens", "mine.model")
    other = prepare(str(tmp_path / "o"), files=[corpus_file], progress=False, workers=1, vocab_size=400)
    import shutil
    shutil.copy(os.path.join(tmp_path, "o", "tokenizer.model"), inner)
    meta = prepare(out, files=[corpus_file], tokenizer=inner, overwrite=True, **PREPARED)
    assert os.path.exists(inner) and meta["tokenizer_sha256"] == other["tokenizer_sha256"]
    assert not os.path.exists(os.path.join(out, "tokenizer.vocab"))        # the old trained tokenizer's


def load_cli():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "data", "prepare_fineweb.py")
    spec = importlib.util.spec_from_file_location("prepare_fineweb_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_refuses_with_exit_2_and_overwrites_on_request(tmp_path, prepared, corpus_file, capsys):
    cli = load_cli()
    out = copy_of(prepared, tmp_path)
    argv = ["--files", corpus_file, "--out", out, "--vocab-size", "400", "--val-fraction", "0.2",
            "--docs-per-shard", "16", "--workers", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "traceback" not in err.lower()
    assert "vocab_size 320 there, 400 requested; pass --overwrite" in err
    assert cli.main(argv + ["--overwrite"]) == 0
    assert json.load(open(os.path.join(out, "tokens", "metadata.json")))["vocab_size"] == 400
