"""Tensor parallelism (attn layers, vocab-parallel embedding and loss) against one process."""
import sys
from types import SimpleNamespace

import pytest

import fpscale
from fpscale.parallel.parallelize import parallelize
from tests.parallel.launch import read_ranks, run, torchrun

SCRIPT = "tests/parallel/run_layout.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref_attn")
    run([sys.executable, SCRIPT, str(out), "config=tiny_attn.yaml"], timeout=300)
    (ref,) = read_ranks(str(out))
    return ref


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,zero", [(2, 1), (4, 2)], ids=["tp2-zero1", "tp2xdp2-zero2"])
def test_tp_layouts_match_one_process(tmp_path, reference, nproc, zero):
    torchrun(nproc, SCRIPT, [str(tmp_path), "config=tiny_attn.yaml", "parallel.tp=2", f"zero_stage={zero}"],
             timeout=400)
    ranks = read_ranks(str(tmp_path))
    assert len(ranks) == nproc
    for r in ranks:
        # fp32; sharded matmuls and reductions sum in another order than one process
        for got, want in zip(r["steps"], reference["steps"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


def test_bad_tp_sizes_name_the_numbers():
    state = SimpleNamespace(tp_size=3, tp_rank=0, tp_group=None)
    with pytest.raises(ValueError, match=r"model.n_heads = 4 is not divisible by parallel.tp = 3"):
        parallelize(fpscale.build_model(fpscale.load_config(None, ["model.layers.0.type=attn"])), state)
    state.tp_size = 2
    with pytest.raises(ValueError, match=r"model.vocab_size = 8001 is not divisible by parallel.tp = 2"):
        parallelize(fpscale.build_model(fpscale.load_config(None, ["model.vocab_size=8001"])), state)
    with pytest.raises(ValueError, match=r"shards attn layers only so far; model.layers.0 is 'fpsa'"):
        parallelize(fpscale.build_model(fpscale.load_config(None, ["model.layers.0.type=fpsa"])), state)


def test_decoding_a_tp_shard_is_refused():
    import torch
    state = SimpleNamespace(tp_size=2, tp_rank=0, tp_group=None)
    model = parallelize(fpscale.build_model(fpscale.load_config(None, ["model.vocab_size=32"])), state)
    with pytest.raises(ValueError, match="split over tensor-parallel ranks"):
        fpscale.generate(model, torch.zeros(1, 3, dtype=torch.long), 2)


def test_world_size_not_divisible_by_tp(monkeypatch):
    from fpscale.parallel.state import init_parallel
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by parallel.tp = 2"):
        init_parallel(2)
