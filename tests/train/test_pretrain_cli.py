"""launch/pretrain.py end to end on a synthetic task: run directory, metrics, TensorBoard, export."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fpscale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=16", "model.d_model=32",
             "model.max_seq_len=32", "train.steps=6", "train.log_interval=3", "train.eval_interval=6",
             "train.eval_batches=2", "train.micro_batch=4", "train.global_batch=4"]


@pytest.mark.slow
def test_pretrain_cli_writes_run_directory(tmp_path):
    cmd = [sys.executable, "launch/pretrain.py", "--config", "configs/tiny_mixed.yaml", *OVERRIDES,
           f"train.out_dir={tmp_path}", "name=cli"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "validation at step 6" in proc.stdout and "layers.1.fpsa" in proc.stdout
    run = tmp_path / "cli"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "layers"):
        assert key in train[0]
    assert set(train[0]["layers"]) == {"layers.1.fpsa", "layers.2.fpmamba", "layers.3.looped"}
    assert {"iters_mean", "iters_median", "iters_p90", "iters_max", "residual_p50", "converged_fraction",
            "eta"} <= set(train[0]["layers"]["layers.1.fpsa"])
    assert any(r["kind"] == "val" and "val_ppl" in r for r in records)
    # the kernels that ran in the interval, counted at the call: SDPA on CPU, q, k and v in fp32
    val = [r for r in records if r["kind"] == "val"][-1]
    for record in (train[0], train[1], val):
        assert set(record["kernels"]["attention"]) == {"sdpa fp32"} and record["kernels"]["attention"]["sdpa fp32"] > 0
        assert record["memory_gib"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/val_loss", "train/ppl",
            "train/tflops_nominal", "train/tflops_executed", "train/memory_gib",
            "solver/layers.1.fpsa/iters_mean"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [3, 6]
    assert fpscale.load_config(str(run / "config.yaml")).data.seq_len == 16
    assert (run / "final" / "model.safetensors").exists()


def test_exported_weights_reproduce_the_model(tmp_path):
    from safetensors.torch import load_file

    from fpscale.train.trainer import Trainer
    cfg = fpscale.load_config(os.path.join(ROOT, "configs/tiny_looped.yaml"),
                              OVERRIDES + [f"train.out_dir={tmp_path}", "name=exp"])
    trainer = Trainer(cfg, log=True)
    trainer.train()
    fresh = fpscale.build_model(fpscale.load_config(str(tmp_path / "exp" / "final" / "config.yaml")))
    fresh.load_state_dict(load_file(str(tmp_path / "exp" / "final" / "model.safetensors")), strict=False)
    tokens = torch.randint(0, 16, (2, 12))
    trainer.model.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(trainer.model(tokens), fresh(tokens))


@pytest.mark.slow     # a child process (imports torch: seconds): the full suite, not the quick loop
def test_cli_config_error_exits_2_naming_the_key():
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny_attn.yaml",
                           "train.lr=-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.min_lr" in proc.stderr and "Traceback" not in proc.stderr


def test_peak_memory_is_per_interval():
    """The reported peak is the interval's own: a large allocation before a reset does not show after it."""
    import numpy as np

    from fpscale.train.metrics import peak_memory_gib, reset_peak_memory
    cpu = torch.device("cpu")
    big = np.ones(2 ** 28 // 8)                # 256 MiB, touched
    before = peak_memory_gib(cpu)
    del big
    reset_peak_memory(cpu)
    assert peak_memory_gib(cpu) < before - 0.2
