"""Resume on one process: a checkpoint of another model, other data or another global batch is
refused by name; keep_last rotation; train.stop_at ends a time slice that resumes to train.steps."""
import json
import os

import pytest

import fpscale
from fpscale.train.checkpoint import CheckpointError
from fpscale.train.schedule import lr_at
from fpscale.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=16", "model.d_model=32",
        "model.max_seq_len=32", "train.steps=6", "train.warmup=2", "train.log_interval=1", "train.eval_interval=6",
        "train.eval_batches=1", "train.micro_batch=4", "train.global_batch=4", "train.export_final=false"]


def config(tmp_path, name: str, *overrides: str):
    return fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml"),
                               TINY + [f"train.out_dir={tmp_path}", f"name={name}", *overrides])


def train(tmp_path, name: str, *overrides: str) -> list[dict]:
    with Trainer(config(tmp_path, name, *overrides), log=True) as trainer:
        return trainer.train()


def checkpoints(tmp_path, name: str) -> list[str]:
    return sorted(os.listdir(tmp_path / name / "checkpoints"))


def train_records(tmp_path, name: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 2 of a one-process run."""
    out = tmp_path_factory.mktemp("runs")
    train(out, "saved", "train.steps=2")
    return out / "saved" / "checkpoints" / "step_00000002"


@pytest.mark.parametrize("override, names", [
    ("model.d_model=48", ["other tensor shapes", "embed.weight: [16, 32] saved, [16, 48] here"]),
    ("data.period=5", ["trained on other data", "'period': 3"]),
    ("train.global_batch=8", ["train.global_batch = 8 differs from the checkpoint's 4"]),
])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_difference(tmp_path, saved, override, names):
    with pytest.raises(CheckpointError) as refused:
        Trainer(config(tmp_path, "other", f"train.resume={saved}", override), log=False)
    for name in names:
        assert name in str(refused.value)


def test_the_same_config_resumes_from_the_checkpoint(tmp_path, saved):
    with Trainer(config(tmp_path, "same", f"train.resume={saved}"), log=False) as trainer:
        assert trainer.step == 2 and trainer.batches.consumed_samples == 8


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    train(tmp_path, "rotated", "train.save_interval=1", "train.keep_last=2")
    assert checkpoints(tmp_path, "rotated") == [".partial", "step_00000005", "step_00000006"]
    assert os.listdir(tmp_path / "rotated" / "checkpoints" / ".partial") == []


def test_stop_at_ends_a_time_slice_that_resumes_to_train_steps(tmp_path):
    train(tmp_path, "straight")
    straight = train_records(tmp_path, "straight")
    first = train(tmp_path, "sliced", "train.stop_at=4")
    assert [r["step"] for r in first if r["kind"] == "train"] == [1, 2, 3, 4]
    assert checkpoints(tmp_path, "sliced") == [".partial", "step_00000004"]
    t = config(tmp_path, "sliced").train
    assert lr_at(3, t.lr, t.min_lr, t.warmup, t.steps) != pytest.approx(lr_at(3, t.lr, t.min_lr, t.warmup, 4))
    for step, record in train_records(tmp_path, "sliced").items():     # the schedule runs to train.steps
        assert record["lr"] == pytest.approx(lr_at(step - 1, t.lr, t.min_lr, t.warmup, t.steps)), step
    rest = train(tmp_path, "sliced")
    assert [r["step"] for r in rest if r["kind"] == "train"] == [5, 6]
    sliced = train_records(tmp_path, "sliced")
    assert sorted(sliced) == [1, 2, 3, 4, 5, 6]
    for step in sliced:                # one process, fp32: the slices continue exactly
        assert sliced[step]["loss"] == straight[step]["loss"], step
        assert sliced[step]["lr"] == straight[step]["lr"], step
