"""The DeepSpeed config of a run, from fpscale's config and batch plan: what the trainer hands
``deepspeed.initialize`` and what the memory planner (fpscale.train.memory_plan) reads its precisions from."""
from __future__ import annotations

from fpscale.config import Config
from fpscale.log import get_logger
from fpscale.train.config import BatchPlan

logger = get_logger(__name__)


def deepspeed_config(cfg: Config, plan: BatchPlan, load_universal: bool = False) -> dict:
    """The DeepSpeed config of a run. bf16 is Megatron's: bf16 weights and activations, gradients
    accumulated over the micro-batches and reduced over the data-parallel ranks in fp32 (DeepSpeed's
    defaults follow the model dtype: bf16 for both). What DeepSpeed 0.19.8 does with it, per rank
    (P parameters, N data-parallel ranks; docs/parallel.md "bf16"): ZeRO-1 runs BF16_Optimizer, a
    whole fp32 gradient buffer (+4 bytes x P, not sharded; gone is the bf16 reduce bucket of
    reduce_bucket_size elements the ZeRO-1 optimizer allocated while accumulating); ZeRO-2 and ZeRO-3
    keep their gradient partitions in fp32 (+2 bytes x P / N) and ZeRO-3 its reduce bucket too
    (+2 bytes x reduce_bucket_size, 1 GB at DeepSpeed's default). ZeRO-0 reduces in fp32 but
    accumulates in bf16: DeepSpeed refuses fp32 accumulation without ZeRO ("unsupported mix of
    model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32")."""
    t = cfg.train
    bf16 = t.precision == "bf16"
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": bf16},
        # fpscale passes torch's AdamW: no fused-Adam JIT build, the same update as one process
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "checkpoint": {"load_universal": load_universal},
    }
    if bf16:
        config["communication_data_type"] = "fp32"
        if cfg.parallel.zero_stage > 0:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        elif plan.grad_accum > 1:
            logger.info("bf16 with ZeRO-0: gradients are reduced in fp32 but accumulated over the %d "
                        "micro-batches in bf16 (DeepSpeed has no fp32 accumulation without ZeRO; "
                        "parallel.zero_stage=1 has it)", plan.grad_accum)
    return config
