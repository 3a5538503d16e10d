import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fpscale.data.prepare import prepare

WORDS = ("fixed point iteration converges when the map is a contraction; damping helps "
         "oscillating maps. Ünïcödé — ελληνικά 中文 emoji 🙂 and code:\n    def f(x):\n        return x\n").split(" ")


def make_docs(n: int, seed: int = 0) -> list[dict]:
    import random
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80)))
        docs.append({"text": text, "id": f"<urn:test:{i}>", "dump": "test", "url": f"https://x/{i}",
                     "date": "", "file_path": "", "language": "en", "language_score": 1.0})
    return docs


def write_parquet(path, docs) -> str:
    pq.write_table(pa.Table.from_pylist(docs), str(path))
    return str(path)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("raw") / "docs.parquet", make_docs(120))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("prep")
    prepare(str(out), files=[corpus_file], vocab_size=320, val_fraction=0.2, docs_per_shard=16, workers=2,
            progress=False)
    return str(out)


@pytest.fixture(scope="session")
def blend_sources(tmp_path_factory, prepared):
    """Three prepared folders sharing ``prepared``'s tokenizer, of different sizes (the small one
    wraps its epochs many times in a blend): [prepared, medium, small] token folders."""
    tokenizer = prepared + "/tokenizer.model"
    out = [prepared + "/tokens"]
    for n, seed in ((60, 11), (16, 12)):
        folder = tmp_path_factory.mktemp(f"blend{n}")
        prepare(str(folder), files=[write_parquet(folder / "docs.parquet", make_docs(n, seed))], tokenizer=tokenizer,
                val_fraction=0.2, docs_per_shard=16, workers=1, progress=False)
        out.append(str(folder / "tokens"))
    return out


def blend_config(paths: list[str], weights=(0.5, 0.3, 0.2), seq_len: int = 16, **entry):
    """A data section blending ``paths`` (a DataConfig, validated as a config load would)."""
    from fpscale.data.config import DataConfig
    from fpscale.typed import from_dict
    blend = [{"path": p, "weight": w, **entry} for p, w in zip(paths, weights)]
    return from_dict(DataConfig, {"blend": blend, "seq_len": seq_len}, "data")


def train_hf_tokenizer(path, texts, vocab_size: int = 300) -> str:
    """A byte-level BPE ``tokenizer.json`` made with the ``tokenizers`` library, GPT-2 style, with
    ``<|endoftext|>`` as its special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def hf_prepared(tmp_path_factory, corpus_file):
    """``corpus_file`` prepared with a tokenizer.json (another tokenizer than ``prepared``'s)."""
    folder = tmp_path_factory.mktemp("hfprep")
    tok = train_hf_tokenizer(folder / "made.json", [d["text"] for d in make_docs(200, seed=9)])
    prepare(str(folder / "out"), files=[corpus_file], tokenizer=tok, val_fraction=0.2, docs_per_shard=32, workers=1,
            progress=False)
    return str(folder / "out")


@pytest.fixture(scope="session")
def megatron_prefixes(tmp_path_factory, prepared):
    """Megatron indexed datasets written by megatron-core's own IndexedDatasetBuilder, in the two
    dtypes it writes (uint16 for vocabularies under 65500, int32 above): {dtype: (prefix, documents)}.
    The documents are ``make_docs`` encoded with ``prepared``'s tokenizer plus its EOS (what
    Megatron's preprocess_data.py --append-eod writes); every third one is added as two items
    (sentences) and closed with end_document, the rest with add_document."""
    import numpy as np
    import sentencepiece as spm
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    sp = spm.SentencePieceProcessor(model_file=prepared + "/tokenizer.model")
    docs = [np.array(ids + [sp.eos_id()]) for ids in sp.encode([d["text"] for d in make_docs(90, seed=21)])]
    folder = tmp_path_factory.mktemp("megatron")
    out = {}
    for dtype in (np.uint16, np.int32):
        prefix = str(folder / f"text_{np.dtype(dtype).name}_document")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for i, doc in enumerate(docs):
            if i % 3 == 0 and len(doc) > 2:
                cut = len(doc) // 2
                builder.add_item(torch.from_numpy(doc[:cut]))
                builder.add_item(torch.from_numpy(doc[cut:]))
                builder.end_document()
            else:
                builder.add_document(torch.from_numpy(doc), [len(doc)])
        builder.finalize(prefix + ".idx")
        out[np.dtype(dtype).name] = (prefix, docs)
    return out
