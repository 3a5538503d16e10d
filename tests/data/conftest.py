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
