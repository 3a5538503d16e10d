"""Megatron indexed datasets (.bin + .idx written by megatron-core's IndexedDatasetBuilder) read in
place: the same tokens and document boundaries in both dtypes the builder writes, packed into
seq_len + 1 samples like fpscale's shards, the last documents held out; clear errors for an index
version or a dtype fpscale does not read."""
import numpy as np
import pytest

from fpscale.data.megatron import MegatronIndexed, read_index
from fpscale.errors import DataError


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_tokens_and_document_boundaries_are_the_builders(megatron_prefixes, dtype):
    prefix, docs = megatron_prefixes[dtype]
    assert read_index(prefix + ".idx")["dtype"] == np.dtype(dtype)
    train = MegatronIndexed(prefix, "train", 16, val_fraction=0.1)
    val = MegatronIndexed(prefix, "val", 16, val_fraction=0.1)
    assert (train.documents, val.documents) == (81, 9)
    stream = np.concatenate(docs)
    assert np.array_equal(np.asarray(train.stream), stream)                       # the .bin, as written
    assert np.array_equal(train.doc_ends, np.cumsum([len(d) for d in docs]))      # boundaries from the .idx
    cut = sum(len(d) for d in docs[:81])
    assert (train.begin, train.end, val.begin, val.end) == (0, cut, cut, len(stream))
    for i in (0, 1, train.num_samples - 1):
        assert np.array_equal(train.sample(i), stream[i * 16:i * 16 + 17])
    assert np.array_equal(val.sample(0), stream[cut:cut + 17])
    assert train.num_samples == (cut - 1) // 16 and train.batch([0, 2]).dtype.is_floating_point is False
    assert train.fingerprint() != val.fingerprint()


def test_a_version_or_dtype_it_does_not_read_is_named(megatron_prefixes, tmp_path):
    prefix, _ = megatron_prefixes["uint16"]
    head = open(prefix + ".idx", "rb").read()
    for name, patched, says in (("v2", head[:9] + (2).to_bytes(8, "little") + head[17:], "index version 2; fpscale "
                                 "reads version 1"),
                                ("f32", head[:17] + bytes([7]) + head[18:], "token dtype float32 \\(code 7\\)"),
                                ("junk", b"NOTANIDX" + head[8:], "no MMIDIDX header")):
        (tmp_path / f"{name}.idx").write_bytes(patched)
        (tmp_path / f"{name}.bin").write_bytes(open(prefix + ".bin", "rb").read())
        with pytest.raises(DataError, match=says):
            MegatronIndexed(str(tmp_path / name), "train", 16)
    (tmp_path / "short.idx").write_bytes(head)
    (tmp_path / "short.bin").write_bytes(open(prefix + ".bin", "rb").read()[:-2])
    with pytest.raises(DataError, match="short.bin has .* bytes, its .idx records"):
        MegatronIndexed(str(tmp_path / "short"), "train", 16)
    with pytest.raises(DataError, match="no Megatron indexed dataset at"):
        MegatronIndexed(str(tmp_path / "none"), "train", 16)
