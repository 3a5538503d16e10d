"""Training section of the run config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fpscale.errors import LayoutError, check
from fpscale.train.optim_config import MuonConfig, check_groups


@dataclass
class TrainConfig:
    """The batch: ``global_batch`` sequences per optimizer step, or ``global_batch_tokens`` (a token
    count, the way recipes state it: global_batch = global_batch_tokens / data.seq_len). At launch
    it splits as micro-batch x grad_accum x data-parallel size (``resolve_batch``): ``micro_batch``
    is the most a device takes; with ``grad_accum: 0`` (default) each rank runs the largest
    micro-batch up to it that divides its share, and accumulates the rest, so one recipe runs on
    8 or 64 ranks unchanged. A set ``grad_accum`` fixes the split: the three must multiply out.

    lr schedule (``schedule``): linear warm-up for ``warmup`` steps, then ``cosine`` to ``min_lr`` at
    ``steps``, ``constant``, or ``wsd`` (stable at ``lr``, then the last ``decay_fraction`` of the steps
    decay to ``min_lr``, ``decay_shape`` linear or 1-sqrt). ``optimizer``: ``adamw`` (torch's) or
    ``muon_adamw`` (Muon for the blocks' weight matrices, ``muon`` its settings). Parameters fall in
    groups by role (muon, matrix, other, embed, head, norm, scalar; fpscale/train/optimizers.py), each
    with ``lr_scale.<group>`` x the scheduled lr, ``group_weight_decay.<group>`` (default: weight_decay
    for matrices and other >= 2-D block weights, none for norms, biases, scalars and embeddings),
    ``group_betas.<group>``; ``group_override: {layers.3: adamw-group}`` moves every parameter under
    a name prefix to a group. docs/optimizers.md.

    ``eval_depths: [1, 4, 16]`` also validates once per depth, every looped layer capped at that
    many solver iterations (test-time compute): the val record gains ``depths`` and scalars
    ``val_loss_depth_4`` ... (TensorBoard ``val/val_loss_depth_4``). Empty (default): no sweep.

    Checkpoints: every ``save_interval`` steps, every ``save_interval_minutes`` (default 30; the
    timer runs on rank 0 and every rank agrees at a step boundary) and at the end, so a kill that
    no handler sees (SIGKILL, a dead node) loses at most one interval; SIGTERM / SIGUSR1 save at
    the next step boundary (fpscale/train/signals.py).

    ``export_final: true`` ends the run with rank 0 merging the last checkpoint into whole weights
    (``final/model.safetensors``): one process reading every shard, seconds at the tiny configs,
    minutes to hours at billions of parameters, so the GPU recipes leave it to
    ``launch/convert.py`` on demand.
    """

    steps: int = 300
    micro_batch: int | Literal["auto"] = 8   # auto: the largest that fits (fpscale.train.memory_plan)
    grad_accum: int = 0
    global_batch: int = 8
    global_batch_tokens: int = 0  # > 0: the global batch as a token count (replaces global_batch)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8           # AdamW's epsilon (every AdamW group; Attractor's recipes: 1e-10)
    optimizer: Literal["adamw", "muon_adamw"] = "adamw"
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2           # wsd: the fraction of train.steps spent decaying to min_lr
    decay_shape: Literal["linear", "1-sqrt"] = "linear"    # wsd's decay
    lr_scale: dict[str, float] = field(default_factory=dict)              # group -> lr multiplier
    group_weight_decay: dict[str, float] = field(default_factory=dict)    # group -> weight decay
    group_betas: dict[str, list[float]] = field(default_factory=dict)     # AdamW group -> [beta1, beta2]
    group_override: dict[str, str] = field(default_factory=dict)          # parameter-name prefix -> group
    muon: MuonConfig = field(default_factory=MuonConfig)
    grad_clip: float = 1.0
    precision: Literal["fp32", "bf16"] = "fp32"
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 8
    eval_depths: list[int] = field(default_factory=list)   # evaluation depths to sweep at each validation
    out_dir: str = "runs"
    save_interval: int = 0        # steps between checkpoints (0 = none by count); the end is always saved
    save_interval_minutes: float = 30.0   # minutes between checkpoints on rank 0's clock (0 = none by time)
    export_final: bool = False    # at the end, also merge the last checkpoint into final/ (docstring)
    keep_last: int = 3            # checkpoints kept in runs/<name>/checkpoints (0 = all)
    resume: str = "auto"          # auto (newest complete checkpoint of this run, if any) | none | a folder
    stop_at: int = 0              # save and end this run at this step (a time slice); 0 = at train.steps
    init_weights: str = ""        # start from whole weights: a folder with model.safetensors (launch/convert.py)
    peak_tflops: float = 0.0      # device peak for MFU; 0 = a known GPU (fpscale/train/flops.py), else no MFU
    gpu_memory_gib: float = 0.0   # the budget micro_batch: auto plans for; 0 = the GPU's own memory
    loggers: list[Literal["tensorboard", "wandb"]] = field(default_factory=lambda: ["tensorboard"])  # + jsonl
    wandb_project: str = "fpscale"
    wandb_mode: Literal["auto", "offline", "online"] = "auto"   # auto: offline unless an API key is set
    # torch.compile (fpscale.parallel.compile, docs/solver.md): auto = none on CPU; on CUDA model (plain and
    # one-pass stacks) or blocks (looped layers)
    compile: Literal["auto", "none", "model", "blocks", "full"] = "auto"

    def validate(self, prefix: str = "train") -> None:
        check(self.grad_accum >= 0, f"{prefix}.grad_accum", f"must be >= 0 (0 = derive), got {self.grad_accum}")
        auto = self.micro_batch == "auto"
        check(not (auto and self.grad_accum), f"{prefix}.grad_accum",
              f"must be 0 (derived) with micro_batch: auto, got {self.grad_accum}")
        check(self.gpu_memory_gib >= 0, f"{prefix}.gpu_memory_gib",
              f"must be >= 0 (0 = the GPU's memory), got {self.gpu_memory_gib}")
        for name in ("steps", *(() if auto else ("micro_batch",)), "global_batch", "log_interval", "eval_interval",
                     "eval_batches"):
            check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(all(d >= 1 for d in self.eval_depths), f"{prefix}.eval_depths",
              f"every depth (a solver iteration cap) must be >= 1, got {self.eval_depths}")
        check(len(set(self.eval_depths)) == len(self.eval_depths), f"{prefix}.eval_depths",
              f"lists a depth twice: {self.eval_depths}")
        check(self.warmup >= 0, f"{prefix}.warmup", f"must be >= 0, got {self.warmup}")
        check(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"{prefix}.min_lr",
              f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        check(self.global_batch_tokens >= 0, f"{prefix}.global_batch_tokens",
              f"must be >= 0 (0 = use global_batch), got {self.global_batch_tokens}")
        if self.grad_accum:
            per_rank = self.micro_batch * self.grad_accum
            check(self.global_batch % per_rank == 0, f"{prefix}.global_batch",
                  f"must be micro_batch x grad_accum x data-parallel size: {self.global_batch} is not a multiple "
                  f"of {self.micro_batch} x {self.grad_accum} = {per_rank} (or set train.grad_accum: 0 to derive it)")
        check(self.peak_tflops >= 0, f"{prefix}.peak_tflops", f"must be >= 0 (0 = auto), got {self.peak_tflops}")
        check(self.save_interval >= 0, f"{prefix}.save_interval", f"must be >= 0 (0 = at the end), got "
              f"{self.save_interval}")
        check(self.save_interval_minutes >= 0, f"{prefix}.save_interval_minutes",
              f"must be >= 0 (0 = no timed saves), got {self.save_interval_minutes}")
        check(self.stop_at >= 0, f"{prefix}.stop_at", f"must be >= 0 (0 = train.steps), got {self.stop_at}")
        check(self.keep_last >= 0, f"{prefix}.keep_last", f"must be >= 0 (0 = keep all), got {self.keep_last}")
        check(bool(self.resume), f"{prefix}.resume", "must be auto, none or a checkpoint folder")
        check(self.grad_clip >= 0, f"{prefix}.grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")
        check(self.compile in ("auto", "none", "model", "blocks", "full"), f"{prefix}.compile",
              f"must be one of auto, none, model, blocks, full, got {self.compile!r}")
        check(len(set(self.loggers)) == len(self.loggers), f"{prefix}.loggers", f"lists a logger twice: {self.loggers}")
        check(self.weight_decay >= 0, f"{prefix}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        check_groups(self, prefix)


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch splits on this layout."""
    global_batch: int      # sequences per optimizer step
    micro_batch: int       # sequences per forward on one device
    grad_accum: int        # forwards per optimizer step on one device
    dp_size: int

    def describe(self, seq_len: int) -> str:
        return (f"global batch {self.global_batch} x {seq_len} tokens = micro-batch {self.micro_batch} x "
                f"grad_accum {self.grad_accum} x data-parallel {self.dp_size}")


def resolve_batch(t: TrainConfig, dp_size: int) -> BatchPlan:
    """Split ``t.global_batch`` over ``dp_size`` ranks, or a LayoutError with the numbers and a fix.
    Derived accumulation: the largest micro-batch <= ``t.micro_batch`` dividing each rank's share."""
    g = t.global_batch
    if t.micro_batch == "auto":
        raise ValueError("train.micro_batch: auto is resolved by the trainer (memory_plan.auto_micro_batch) first")
    if g % dp_size:
        lo, hi = g // dp_size * dp_size, -(-g // dp_size) * dp_size
        nearest = f"{lo} or {hi}" if lo else f"{hi}"
        raise LayoutError(f"train.global_batch = {g} sequences do not split over {dp_size} data-parallel ranks: "
                         f"use a multiple of {dp_size} (e.g. {nearest}) or another number of ranks")
    share = g // dp_size
    if t.grad_accum:
        if share != t.micro_batch * t.grad_accum:
            raise LayoutError(f"train.global_batch = {g} must equal train.micro_batch ({t.micro_batch}) x "
                             f"train.grad_accum ({t.grad_accum}) x data-parallel size ({dp_size}) = "
                             f"{t.micro_batch * t.grad_accum * dp_size}; set train.grad_accum: 0 to derive it")
        return BatchPlan(g, t.micro_batch, t.grad_accum, dp_size)
    micro = max(m for m in range(1, min(t.micro_batch, share) + 1) if share % m == 0)
    return BatchPlan(g, micro, share // micro, dp_size)
