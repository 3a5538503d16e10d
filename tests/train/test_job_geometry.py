"""The SLURM example of the README and docs/training.md at its own geometry, simulated on CPU: 2 nodes x 8 GPUs = 16
data-parallel processes (gloo) running launch/pretrain.py on configs/125m_fpsa.yaml's batch settings
(256 sequences a step, micro-batch at most 8, eval_batches 20, ZeRO-1) with a tiny model: they
start, train 2 steps, validate and save, within a timeout."""
import json
import os

import pytest

from tests.parallel.launch import run, torchrun_command

pytestmark = pytest.mark.multiprocess

TINY = ["model.d_model=32", "model.n_heads=4", "model.vocab_size=32", "model.max_seq_len=32",
        "model.layers=[{type: attn}, {type: fpsa, solver: {freeze_converged: true}}, {type: attn}]",
        "data.source=synthetic", "data.seq_len=16", "train.global_batch_tokens=4096",   # 256 x 16 tokens
        "train.precision=fp32", "train.steps=2", "train.warmup=1", "train.log_interval=1",
        "train.eval_interval=2", "parallel.timeout_s=120"]


def test_the_readme_slurm_example_geometry_trains_and_validates_on_16_ranks(tmp_path):
    cmd = torchrun_command(16, "launch/pretrain.py", "--config", "configs/125m_fpsa.yaml", *TINY,
                           f"train.out_dir={tmp_path}", "name=geometry")
    out = run(cmd, timeout=600).stdout
    assert "global batch 256 x 16 tokens = micro-batch 8 x grad_accum 2 x data-parallel 16" in out, out[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "geometry" / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    (val,) = [r for r in rows if r["kind"] == "val"]
    assert [r["step"] for r in train] == [1, 2] and all(r["tokens_per_s"] > 0 for r in train)
    assert val["step"] == 2 and val["val_loss"] == val["val_loss"]         # every rank validated: no hang, no NaN
    ckpt = tmp_path / "geometry" / "checkpoints" / "step_00000002"
    manifest = json.load(open(ckpt / "manifest.json"))
    assert json.load(open(ckpt / "meta.json"))["dp"] == 16 and len(manifest["hashed_bytes_by_rank"]) == 16
    assert not os.path.exists(tmp_path / "geometry" / "final")             # the GPU recipe does not export
