"""The memory planner (fpscale/train/memory_plan.py, fpscale-plan): its saved-bytes prediction
against count_saved_bytes of a real forward at sizes it was not calibrated on, its model states
against DeepSpeed's own estimators, micro_batch: auto, and its errors."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import fpscale
from fpscale.cli.plan import main as plan_main
from fpscale.errors import ConfigError, UserError
from fpscale.models import build_model
from fpscale.profiling import count_saved_bytes
from fpscale.train import memory_plan as mp
from fpscale.train.config import resolve_batch

SMALL = ["model.d_model=128", "model.n_heads=4", "model.vocab_size=1024", "model.max_seq_len=256",
         "data.source=synthetic", "data.seq_len=256", "train.precision=bf16"]
CONFIGS = {"attn": ("configs/125m_attn.yaml", ["model.layers.0.repeat=2"]),
           "fpsa": ("configs/125m_fpsa.yaml", ["model.layers.0.repeat=1", "model.layers.2.repeat=1"]),
           "fpmamba": ("configs/125m_fpmamba.yaml", ["model.layers.0.repeat=2"]),
           "looped": ("configs/125m_looped.yaml", ["model.layers.0.repeat=1", "model.layers.2.repeat=1",
                                                   "model.layers.1.core_blocks=2"]),
           "epsilon": ("configs/125m_epsilon.yaml", ["model.layers.0.repeat=1", "model.layers.2.repeat=1",
                                                     "model.embed_scale=11.3"]),
           "mamba": ("configs/125m_mamba.yaml", ["model.layers.0.repeat=2"])}


def small(kind, *extra):
    path, over = CONFIGS[kind]
    return fpscale.load_config(path, [*SMALL, *over, *extra])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_saved_bytes_within_10_percent(kind):
    """Layers + head saved bytes, predicted from the fit at CALIBRATION sizes, against one real
    forward of the whole model (the trainer's: bf16 weights, targets, training mode) at two others."""
    cfg = small(kind)
    p = mp.plan(cfg, 1, 80, unroll=False, engine="deepspeed")      # bf16 weights, as below
    torch.manual_seed(0)
    model = build_model(cfg).to(torch.bfloat16).train()
    for B, T in [(3, 96), (2, 256)]:
        assert (B, T) not in mp.CALIBRATION
        tokens = torch.randint(0, cfg.model.vocab_size, (B, T))
        with count_saved_bytes(exclude=tuple(model.parameters())) as saved:
            model(tokens, targets=torch.randint(0, cfg.model.vocab_size, (B, T)))
        p.seq_len = T
        act = p.activations(B)
        predicted = sum(v for k, v in act.items() if k != "head (peak)")
        assert abs(predicted - saved.total) / saved.total < 0.10, (kind, B, T, predicted, saved.total)


def test_model_states_equal_deepspeeds_estimators():
    """DeepSpeed's estimators (cpu_offload=False: every state on the GPU) assume mixed precision
    with 16-bit gradient partitions: ZeRO-2 2P + 18P/N (2 params16 on every GPU; 2 grads16 + 4
    grads32 + 4 params32 + 8 moments per partition), ZeRO-3 4 x largest layer + 18P/N. fpscale's
    plan is the same sum where it keeps those states: bf16 accumulation, tp 1. With fp32 gradient
    accumulation (trainer.deepspeed_config's data_types) ZeRO keeps no 16-bit gradient partition:
    2P/N less. ZeRO-3: the estimator's 4 x largest layer is its gathered-parameter allowance, the
    plan's is in its buffers (largest module + prefetch bucket); the estimator counts no 16-bit
    parameter partition, the plan does (2P/N), and no reduce bucket (the plan's buffers)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import model_to_params as params3
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import model_to_params as params2
    gpus = 8
    for stage in (2, 3):
        cfg = small("fpsa", f"parallel.zero_stage={stage}")
        torch.manual_seed(0)
        model = build_model(cfg)
        s = mp.model_states(cfg, gpus)
        P = params2(model)
        assert s.params_per_rank == P
        grads16 = 0 if s.grad_dtype == "fp32" else 2 * P / gpus
        if stage == 2:
            _, ds = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=gpus, cpu_offload=False)
            assert s.weights + s.gradients + s.optimizer == pytest.approx(ds - 2 * P / gpus + grads16, abs=8)
            out = io.StringIO()          # the _all_live form prints the same figure
            with contextlib.redirect_stdout(out):
                estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus)
            line = next(x for x in out.getvalue().splitlines() if "offload_optimizer=none" in x)
            assert float(line.split("|")[1].strip().rstrip("GB")) == pytest.approx(ds / 2 ** 30, abs=0.01)
        else:
            total, largest = params3(model)
            assert largest == s.largest_module
            _, ds, largest_mem = estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=gpus,
                                                                       cpu_offload=False, cpu_offload_params=False)
            plan = s.weights + s.gradients + s.optimizer
            assert plan == pytest.approx(ds - largest_mem - 2 * P / gpus + grads16 + 2 * P / gpus, abs=8)


def test_auto_micro_batch_fits_and_keeps_the_global_batch():
    cfg = small("fpsa", "train.micro_batch=auto", "train.gpu_memory_gib=2.5",
                "train.global_batch=48", "train.global_batch_tokens=0")
    dp = 2
    B = mp.auto_micro_batch(cfg, dp, torch.device("cpu"))
    p = mp.plan(cfg, dp, 2.5, unroll=False)
    assert p.fits(B) and (cfg.train.global_batch // dp) % B == 0
    bigger = [m for m in range(B + 1, 25) if 24 % m == 0]
    assert not bigger or not p.fits(bigger[0])
    cfg.train.micro_batch = B
    split = resolve_batch(cfg.train, dp)
    assert split.micro_batch == B and split.micro_batch * split.grad_accum * dp == 48


def test_errors():
    with pytest.raises(ConfigError, match="gpu_memory_gib"):
        mp.auto_micro_batch(small("attn", "train.micro_batch=auto"), 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match="grad_accum"):
        small("attn", "train.micro_batch=auto", "train.grad_accum=2")
    with pytest.raises(ConfigError, match="micro_batch"):
        small("attn", "train.micro_batch=big")
    with pytest.raises(UserError, match="--gpus"):
        mp.plan(small("attn", "parallel.tp=2"), 3, 40)
    assert plan_main(["--config", "configs/tiny_attn.yaml", "--gpus", "0", "--gpu-memory", "40"]) == 2
    assert plan_main(["--config", "configs/tiny_attn.yaml", "--gpus", "1", "--gpu-memory", "-1"]) == 2
    assert plan_main(["--config", "configs/tiny_attn.yaml", "--gpus", "1", "--gpu-memory", "40",
                      "--micro-batches", "x"]) == 2


def test_the_plan_is_of_the_engine_that_trains():
    """One GPU under parallel.engine auto is the torch engine (the trainer's one process): fp32 weights
    and gradients, two fp32 moments, no buffers, 16 bytes a parameter; DeepSpeed where asked for. The
    row the trainer's memory_gib compares with is ``allocated``: ``total`` without slack and context."""
    cfg = small("fpsa")
    p = mp.plan(cfg, 1, 80, unroll=False)
    P = p.states.params_per_rank
    assert p.engine == "torch" and (p.states.weights, p.states.gradients, p.states.optimizer) == (4 * P, 4 * P, 8 * P)
    assert p.states.buffers == 0
    assert p.total(2) == pytest.approx(mp.SLACK * p.allocated(2) + mp.CONTEXT_GIB * mp.GiB)
    assert mp.plan_engine(small("fpsa", "parallel.zero_stage=1"), 1) == "deepspeed"    # ZeRO asked for
    assert mp.plan_engine(cfg, 2) == "deepspeed" and mp.model_states(cfg, 1, "deepspeed").buffers > 0
    with pytest.raises(UserError, match="torch engine trains one process"):
        mp.plan(small("fpsa", "parallel.engine=torch"), 2, 80)


@pytest.mark.slow
def test_the_head_measured_on_fake_tensors_equals_the_cpu_run():
    """FakeTensorMode (shapes and dtypes, nothing computed) gives the head's fit of a real CPU run."""
    for kind, extra in (("attn", ["model.loss_chunk=0"]), ("fpsa", ["model.loss_chunk=128"])):
        cfg = small(kind, *extra)
        for engine in ("deepspeed", "torch"):
            fake = mp.calibrate_head(cfg, 1024, "fake", engine)
            real = mp.calibrate_head(cfg, 1024, "cpu", engine)
            assert fake.chunk == real.chunk
            for a, b in zip(fake.saved + fake.peak, real.saved + real.peak):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-3), (kind, engine, fake, real)


def test_each_distinct_block_is_calibrated_once(monkeypatch):
    """Thirteen entries of one block (repeat aside) are one calibration, each counted with its repeat;
    a block that differs in anything else is its own."""
    import dataclasses
    calls = []
    real = mp.calibrate_layer
    monkeypatch.setattr(mp, "calibrate_layer", lambda cfg, spec, *a: calls.append(spec.type) or real(cfg, spec, *a))
    cfg = small("attn")
    block = cfg.model.layers[0]
    cfg.model.layers = [block] * 12 + [dataclasses.replace(block, repeat=3)]
    p = mp.plan(cfg, 1, 80, unroll=False)
    assert calls == ["attn"] and [f.count for f in p.layers] == [2] * 12 + [3]
    cfg.model.layers = [block, dataclasses.replace(block, checkpoint="block")]
    calls.clear()
    mp.plan(cfg, 1, 80, unroll=False)
    assert calls == ["attn", "attn"]
