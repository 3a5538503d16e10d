"""parallel.engine (fpscale/parallel/state.py resolve_engine): who trains. DeepSpeed at any world
size, one process included, whenever the ``deepspeed`` launcher started the job or ZeRO was asked
for; torch's AdamW in a plain single process. ``deepspeed --num_gpus 1 launch/pretrain.py`` runs the
DeepSpeed engine (ZeRO-1 and ZeRO-3), and its fp32 losses equal the torch engine's."""
import json
import os
import sys

import pytest

import fpscale
from fpscale.errors import ConfigError, LayoutError
from fpscale.parallel.state import launched_by_deepspeed, resolve_engine
from tests.parallel.launch import free_port, pinned, run

DEEPSPEED_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500", "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}


@pytest.mark.parametrize("engine, world, env, want", [
    ("auto", 1, {}, "torch"),                          # python launch/pretrain.py
    ("auto", 1, DEEPSPEED_ENV, "deepspeed"),           # deepspeed --num_gpus 1 launch/pretrain.py
    ("auto", 1, TORCHRUN_ENV, "torch"),                # torchrun --nproc_per_node 1: no DeepSpeed launcher
    ("auto", 2, TORCHRUN_ENV, "deepspeed"),            # several processes: always DeepSpeed
    ("deepspeed", 1, {}, "deepspeed"),
    ("torch", 1, DEEPSPEED_ENV, "torch"),              # asked for: the launcher does not override it
])
def test_which_engine_trains(engine, world, env, want):
    assert resolve_engine(engine, world, env)[0] == want


def test_the_deepspeed_launcher_is_recognised_by_its_variables():
    assert launched_by_deepspeed(DEEPSPEED_ENV)
    assert not launched_by_deepspeed(TORCHRUN_ENV) and not launched_by_deepspeed({})
    assert not launched_by_deepspeed({k: v for k, v in DEEPSPEED_ENV.items() if k != "CROSS_SIZE"})


def test_the_torch_engine_on_several_processes_is_a_layout_error():
    with pytest.raises(LayoutError, match="parallel.engine = torch trains one process"):
        resolve_engine("torch", 2, {})


def test_zero_asked_for_means_deepspeed_and_the_key_is_validated():
    assert fpscale.load_config(None).parallel.engine == "auto"          # zero_stage's default is no request
    assert fpscale.load_config(None, ["parallel.zero_stage=3"]).parallel.engine == "deepspeed"
    assert fpscale.load_config(None, ["parallel.zero_stage=0"]).parallel.engine == "auto"
    assert fpscale.load_config(None, ["parallel.zero_stage=1", "parallel.engine=torch"]).parallel.engine == "torch"
    # a YAML with zero_stage asks for ZeRO; one that names the engine too (a run's config.yaml) keeps it
    assert fpscale.config.config_from_dict({"parallel": {"zero_stage": 3}}).parallel.engine == "deepspeed"
    assert fpscale.config.config_from_dict({"parallel": {"zero_stage": 3, "engine": "auto"}}).parallel.engine == "auto"
    with pytest.raises(ConfigError, match="parallel.engine"):
        fpscale.load_config(None, ["parallel.engine=ddp"])


ARGS = ["--config", "configs/tiny_mixed.yaml", "data.source=synthetic", "data.seq_len=32", "train.precision=fp32",
        "train.steps=5", "train.warmup=1", "train.log_interval=1", "train.eval_interval=1000",
        "train.global_batch_tokens=0", "train.global_batch=2", "train.micro_batch=1", "train.resume=none",
        "train.export_final=false", "train.save_interval=0"]
ARGS += pinned("configs/tiny_mixed.yaml", ARGS[2:])     # fixed solver depths: DeepSpeed's flat AdamW rounds otherwise


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_deepspeed_on_one_process_equals_the_torch_engine(tmp_path):
    """``deepspeed --num_gpus 1`` runs the DeepSpeed engine with ZeRO-1 and ZeRO-3 (the same AdamW,
    flattened and partitioned over one rank; gradients accumulated over 2 micro-batches), and its
    five fp32 losses equal the plain one-process run's to 1e-5."""
    out = str(tmp_path)
    ref = run([sys.executable, "launch/pretrain.py", *ARGS, f"train.out_dir={out}", "name=torch"], timeout=300)
    assert "engine torch" in ref.stdout, ref.stdout[-2000:]
    want = losses(tmp_path / "torch")
    assert len(want) == 5
    for zero in (1, 3):
        name = f"zero{zero}"
        proc = run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                    str(free_port()), "launch/pretrain.py", *ARGS, f"train.out_dir={out}", f"name={name}",
                    f"parallel.zero_stage={zero}"], timeout=400)
        assert f"engine deepspeed, zero {zero}" in proc.stdout, proc.stdout[-3000:]
        got = losses(tmp_path / name)
        assert got == pytest.approx(want, abs=1e-5), (zero, got, want)
        # the run records the engine that ran, and its checkpoint is DeepSpeed's
        assert "engine: deepspeed" in (tmp_path / name / "config.yaml").read_text()
        [ckpt] = (tmp_path / name / "checkpoints").glob("step_*")
        assert json.loads((ckpt / "meta.json").read_text())["kind"] == "deepspeed"
    assert "engine: torch" in (tmp_path / "torch" / "config.yaml").read_text()
