"""The same DeepSpeed run three times on the same ranks: fp32, bf16 with DeepSpeed's own bf16
defaults (gradients accumulated over micro-batches and reduced over ranks in bf16: fpscale's config
before it asked for fp32) and bf16 as fpscale configures it now (accumulated and reduced in fp32).
Used by tests/parallel/test_bf16_accumulation.py.

    torchrun --nproc_per_node 2 tests/parallel/run_bf16_accumulation.py OUT_DIR PLAN [key=value ...]

PLAN: ZERO_STAGE:SEEDS[:STEPS] entries joined by "/", e.g. ``1:1,2,3,4/0:1:2`` (ZeRO-1 with seeds 1-4
and train.steps' 5 steps, then ZeRO-0 with seed 1 for 2 steps): every ZeRO stage the tests need in one
launch (one process group, one import of torch and DeepSpeed). SEEDS: comma-separated seeds (model
initialisation and data), each run in the three variants. Writes rank{RANK}.json: per ZeRO stage,
seed and variant the loss and gradient norm of every step, the first step's accumulated and reduced
gradient's distance to fp32's (relative), the DeepSpeed optimizer wrapper, the data types DeepSpeed
resolved and the accumulation steps.
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fpscale  # noqa: E402
from fpscale.train import trainer as trainer_module  # noqa: E402

BASE = ["data.source=synthetic", "data.seq_len=32", "model.vocab_size=64", "model.d_model=64",
        "model.max_seq_len=32", "train.micro_batch=1", "train.global_batch=32", "train.steps=5", "train.warmup=1",
        "train.lr=1e-2", "train.min_lr=1e-2", "train.log_interval=1000", "train.eval_interval=1000",
        "train.resume=none"]
FP32_KEYS = ("data_types", "communication_data_type")
VARIANTS = (("fp32", "fp32", False), ("bf16_old", "bf16", True), ("bf16_new", "bf16", False))
CURRENT = trainer_module.deepspeed_config


def deepspeed_defaults(*args, **kwargs) -> dict:
    """fpscale's DeepSpeed config without the fp32 accumulation / reduction keys (the old config)."""
    return {k: v for k, v in CURRENT(*args, **kwargs).items() if k not in FP32_KEYS}


def capture_first_gradient(trainer) -> list:
    """Have the engine keep the first step's accumulated, reduced gradient (every parameter, whole,
    float64) as it stands before the optimizer uses it; the list is filled during the first step."""
    import torch
    from deepspeed.utils import safe_get_full_grad
    engine, kept = trainer.engine, []
    step = engine.step

    def keeping_step(*args, **kwargs):
        if not kept and engine.is_gradient_accumulation_boundary():
            kept.append(torch.cat([safe_get_full_grad(p).double().flatten() for p in trainer.model.parameters()]))
        return step(*args, **kwargs)
    engine.step = keeping_step
    return kept


def train(out: str, zero: str, seed: str, precision: str, old: bool, extra: list[str]) -> tuple[dict, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # bf16 raises solver tolerances to its floor, with a warning
        cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_attn.yaml"),
                                  BASE + [f"parallel.zero_stage={zero}", f"train.precision={precision}",
                                          f"seed={seed}", f"train.out_dir={out}", f"name=z{zero}{precision}{old}{seed}",
                                          *extra])
    trainer_module.deepspeed_config = deepspeed_defaults if old else CURRENT
    try:
        trainer = trainer_module.Trainer(cfg, log=False)
    finally:
        trainer_module.deepspeed_config = CURRENT
    first_grad = capture_first_gradient(trainer)
    steps = [trainer.train_step() for _ in range(cfg.train.steps)]
    engine = trainer.engine
    model_dtype, accum_dtype = engine.get_data_types()          # what DeepSpeed made of the config
    record = {"loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
              "first_grad": first_grad[0], "optimizer": type(trainer.optimizer).__name__,
              "grad_accum": trainer.batch.grad_accum, "model_dtype": str(model_dtype),
              "grad_accum_dtype": str(accum_dtype), "communication_data_type": str(engine.communication_data_type)}
    return record, trainer


def main():
    out, plan, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    report, last = {}, None
    for entry in plan.split("/"):
        zero, seeds, *steps = entry.split(":")
        for seed in seeds.split(","):
            runs = {}
            for variant, precision, old in VARIANTS:
                if last is not None:        # one process group for every run: the last one closes it
                    last.owns_state = False
                    last.close()
                runs[variant], last = train(out, zero, seed, precision, old,
                                            extra + [f"train.steps={n}" for n in steps])
            reference = runs["fp32"]["first_grad"]
            for record in runs.values():    # the first step's gradient against fp32's, relative
                record["first_grad_error"] = float((record.pop("first_grad") - reference).norm() / reference.norm())
            report.setdefault(zero, {})[seed] = runs
    with open(os.path.join(out, f"rank{last.state.rank}.json"), "w") as fh:
        json.dump(report, fh)
    last.close()


if __name__ == "__main__":
    main()
