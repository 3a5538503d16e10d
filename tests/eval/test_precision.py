"""Evaluation in the training precision (fpscale.train.precision): launch/evaluate.py evaluates a
bf16 run under bf16 autocast by default, through the same context as training-time validation, so
its loss and iteration counts are the ones the trainer reported; ``--precision`` asks otherwise."""
import json

import pytest
import torch

from fpscale.cli.evaluate import main as evaluate_main
from fpscale.config import config_from_dict
from fpscale.errors import UserError
from fpscale.eval.evaluate import evaluate_checkpoint
from fpscale.parallel.state import ParallelState
from fpscale.solvers.precision import residual_floor, resolvable_tol
from fpscale.train.precision import autocast, eval_precision, set_matmul_precision

TINY = {
    "name": "bf16run", "seed": 1234,
    "model": {"vocab_size": 16, "d_model": 32, "n_heads": 2, "max_seq_len": 32,
              "layers": [{"type": "attn"}, {"type": "fpsa"}, {"type": "looped", "core_blocks": 1}]},
    "solver": {"max_iter": 4, "eval_max_iter": 12, "tol": 0.02, "stop_quantile": 0.0, "backward": "jfb"},
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 1, "micro_batch": 4, "global_batch": 4, "warmup": 1, "log_interval": 1,
              "eval_interval": 1, "eval_batches": 1, "precision": "bf16"},
}


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The report's figures cost more than the evaluation of this tiny model: not drawn here."""
    monkeypatch.setattr("fpscale.eval.evaluate.plot_iterations", lambda report, path: None)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A 1-step one-process bf16 run: (its validation record, its checkpoint folder)."""
    from fpscale.train.trainer import Trainer
    out = tmp_path_factory.mktemp("runs")
    cfg = config_from_dict(TINY, [f"train.out_dir={out}"])
    with Trainer(cfg, log=False) as trainer:
        history = trainer.train()
    (val,) = [r for r in history if r["kind"] == "val"]
    return val, out / "bf16run" / "checkpoints" / "step_00000001"


def iterations(record: dict) -> dict:
    return {name: st["iters_mean"] for name, st in record["layers"].items()}


def test_evaluation_of_a_bf16_run_is_its_training_time_validation(bf16_run, tmp_path):
    val, ckpt = bf16_run
    report = evaluate_checkpoint(str(ckpt), ParallelState(), str(tmp_path / "default"))
    assert report["precision"] == "bf16"
    assert report["val_loss"] == val["val_loss"]             # the same weights, batches and numerics
    assert iterations(report) == iterations(val)
    fp32 = evaluate_checkpoint(str(ckpt), ParallelState(), str(tmp_path / "fp32"), precision="fp32")
    assert fp32["precision"] == "fp32" and fp32["val_loss"] != val["val_loss"]
    assert abs(fp32["val_loss"] - val["val_loss"]) < 0.05 * val["val_loss"]    # bf16 rounding, not another model


def test_the_cli_flag(bf16_run, tmp_path, capsys):
    val, ckpt = bf16_run
    assert evaluate_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "a"), "--precision", "bf16"]) == 0
    bf16 = json.load(open(tmp_path / "a" / "eval.json"))
    assert bf16["precision"] == "bf16" and "in bf16" in capsys.readouterr().out
    assert bf16["val_loss"] == val["val_loss"]
    assert evaluate_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "b"), "--precision", "fp32-strict"]) == 0
    strict = json.load(open(tmp_path / "b" / "eval.json"))
    assert strict["precision"] == "fp32-strict" and strict["val_loss"] != val["val_loss"]
    assert evaluate_main(["--checkpoint", str(ckpt), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "--precision must be one of config, fp32, bf16, fp32-strict, got 'fp16'" in err
    with pytest.raises(UserError, match="--precision must be one of"):
        evaluate_checkpoint(str(ckpt), ParallelState(), str(tmp_path / "c"), precision="half")


def test_one_autocast_context_for_training_and_evaluation():
    cpu = torch.device("cpu")
    with autocast("bf16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for precision in ("fp32", "fp32-strict"):
        with autocast(precision, cpu):
            assert not torch.is_autocast_enabled("cpu")
    assert [eval_precision(f, "bf16") for f in ("config", "fp32", "bf16")] == ["bf16", "fp32", "bf16"]
    assert eval_precision("config", "fp32") == "fp32"
    with pytest.raises(UserError):
        autocast("fp16", cpu)


def test_tf32_is_on_for_fp32_work_on_cuda_only():
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for precision, tf32 in (("fp32", True), ("bf16", False), ("fp32-strict", False)):
            set_matmul_precision(precision, torch.device("cuda"))
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
        set_matmul_precision("fp32", torch.device("cpu"))          # no CUDA work: left alone
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_per_token_l2_floor_is_one_eps_below_float32_and_two_in_it():
    """norm l2 averages a token's rounding over its channels (measured: fpscale.solvers.precision): 1 eps
    of bf16 and TF32; a float32 map keeps the inf norm's 2 eps; the inf norm and sample_l2 are unchanged."""
    assert residual_floor(torch.bfloat16, norm="l2") == 2 ** -7
    assert residual_floor(torch.float32, tf32=True, norm="l2") == 2 ** -10
    assert residual_floor(torch.float32, norm="l2") == residual_floor(torch.float32) == 2 * 2 ** -23
    assert residual_floor(torch.bfloat16) == 2 * 2 ** -7
    assert residual_floor(torch.bfloat16, norm="sample_l2") == pytest.approx(0.6 * 2 ** -7)


def test_a_float32_map_on_tf32_matmuls_has_the_tf32_floor():
    assert residual_floor(torch.float32, tf32=True) == 2 * 2 ** -10
    assert residual_floor(torch.bfloat16, tf32=True) == residual_floor(torch.bfloat16)
    assert resolvable_tol(1e-2, torch.float32, tf32=True) == 1e-2
    with pytest.warns(UserWarning, match="below what a map computed in tf32"):
        assert resolvable_tol(1e-4, torch.float32, "backward_tol", tf32=True) == 2 * 2 ** -10
    assert resolvable_tol(1e-4, torch.float32, "backward_tol") == 1e-4
