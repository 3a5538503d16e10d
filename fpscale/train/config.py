"""Training section of the run config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fpscale.errors import check


@dataclass
class TrainConfig:
    """global_batch = micro_batch x grad_accum x data-parallel size. ``grad_accum: 0`` (default)
    derives the accumulation from the other three at launch; a set value must agree with them.

    lr schedule: linear warm-up for ``warmup`` steps, then cosine to ``min_lr`` at ``steps``.
    Weight decay skips 1-D parameters (norms, biases, scalars) and embeddings.

    ``eval_depths: [1, 4, 16]`` also validates once per depth, every looped layer capped at that
    many solver iterations (test-time compute): the val record gains ``depths`` and scalars
    ``val_loss_depth_4`` ... (TensorBoard ``val/val_loss_depth_4``). Empty (default): no sweep.
    """

    steps: int = 300
    micro_batch: int = 8
    grad_accum: int = 0
    global_batch: int = 8
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: Literal["fp32", "bf16"] = "fp32"
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 8
    eval_depths: list[int] = field(default_factory=list)   # evaluation depths to sweep at each validation
    out_dir: str = "runs"
    save_interval: int = 0        # steps between checkpoints; 0 = only at the end (always saved)
    keep_last: int = 3            # checkpoints kept in runs/<name>/checkpoints (0 = all)
    resume: str = "auto"          # auto (newest complete checkpoint of this run, if any) | none | a folder
    stop_at: int = 0              # save and end this run at this step (a time slice); 0 = at train.steps
    init_weights: str = ""        # start from whole weights: a folder with model.safetensors (launch/convert.py)
    peak_tflops: float = 0.0      # device peak for MFU; 0 = known GPUs (H100/H200/A100), else no MFU

    def validate(self, prefix: str = "train") -> None:
        check(self.grad_accum >= 0, f"{prefix}.grad_accum", f"must be >= 0 (0 = derive), got {self.grad_accum}")
        for name in ("steps", "micro_batch", "global_batch", "log_interval", "eval_interval", "eval_batches"):
            check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(all(d >= 1 for d in self.eval_depths), f"{prefix}.eval_depths",
              f"every depth (a solver iteration cap) must be >= 1, got {self.eval_depths}")
        check(len(set(self.eval_depths)) == len(self.eval_depths), f"{prefix}.eval_depths",
              f"lists a depth twice: {self.eval_depths}")
        check(self.warmup >= 0, f"{prefix}.warmup", f"must be >= 0, got {self.warmup}")
        check(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"{prefix}.min_lr",
              f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        per_rank = self.micro_batch * max(self.grad_accum, 1)
        check(self.global_batch % per_rank == 0, f"{prefix}.global_batch",
              f"must be micro_batch x grad_accum x data-parallel size: {self.global_batch} is not a multiple "
              f"of {self.micro_batch} x {max(self.grad_accum, 1)} = {per_rank}")
        check(self.peak_tflops >= 0, f"{prefix}.peak_tflops", f"must be >= 0 (0 = auto), got {self.peak_tflops}")
        check(self.save_interval >= 0, f"{prefix}.save_interval", f"must be >= 0 (0 = at the end), got "
              f"{self.save_interval}")
        check(self.stop_at >= 0, f"{prefix}.stop_at", f"must be >= 0 (0 = train.steps), got {self.stop_at}")
        check(self.keep_last >= 0, f"{prefix}.keep_last", f"must be >= 0 (0 = keep all), got {self.keep_last}")
        check(bool(self.resume), f"{prefix}.resume", "must be auto, none or a checkpoint folder")
        check(self.grad_clip >= 0, f"{prefix}.grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")


def resolve_grad_accum(t: TrainConfig, dp_size: int) -> int:
    """The gradient-accumulation steps for this data-parallel size, or an error naming the numbers."""
    per_step = t.micro_batch * dp_size
    if t.global_batch % per_step or (t.grad_accum and t.global_batch != per_step * t.grad_accum):
        accum = t.grad_accum or f"global_batch / ({t.micro_batch} x {dp_size})"
        raise ValueError(f"train.global_batch = {t.global_batch} must equal train.micro_batch ({t.micro_batch}) x "
                         f"train.grad_accum ({accum}) x data-parallel size ({dp_size})")
    return t.global_batch // per_step
