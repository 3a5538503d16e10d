"""What one GPU holds in a training step, predicted before a job queues; the largest micro-batch
that fits a memory budget.

    fpscale-plan --config configs/125m_fpmamba.yaml --gpus 8 --gpu-memory 40      # a table
    python launch/plan.py --config configs/125m_fpsa.yaml --gpus 16 --gpu-memory 80 --json
    plan = memory_plan.plan(cfg, gpus=8, gpu_memory_gib=40)       # in code: Plan.fits(B), .largest_micro_batch()

The engine is the one the trainer runs (``plan_engine``; parallel.engine): DeepSpeed for several
GPUs or where asked for (``--engine deepspeed``: a one-GPU job under the ``deepspeed`` launcher),
else torch's AdamW in one process: fp32 weights and gradients P x 4 each, two fp32 moments P x 8,
no master copy, no buffers; activations under bf16 autocast. Under DeepSpeed, per GPU, with P the
parameters of one tensor-parallel rank and D = gpus / parallel.tp the data-parallel size (fpscale
hands torch's AdamW to DeepSpeed; ``trainer.deepspeed_config`` says whether bf16 gradients are
accumulated and reduced in fp32):

  weights      P x 2 (bf16) or 4 (fp32) bytes; / D under ZeRO-3
  gradients    stage 0: the model's gradients P x w, plus fp32 P x 4 at the step under bf16
               (DeepSpeed's FP16_Optimizer flattens them); stage 1: the whole gradients P x w
               (BF16_Optimizer with fp32 accumulation: P x (4 + 2)), plus the fp32 partition P/D x 4
               at the step under bf16 accumulation; stages 2-3: a partition P/D x 4 (fp32
               accumulation or fp32 runs) or P/D x (2 + 4) (bf16 partition + its fp32 copy)
  optimizer    fp32 master P x 4 (only under bf16 at stage 0; ZeRO copies its partition even in
               fp32) + two fp32 moments P x 8; / D for stages 1-3
  buffers      DeepSpeed's defaults: stage 0 flattens up to 5e8 gradient elements for its
               all-reduce; stages 1-2 one reduce bucket (5e8 elements, in the accumulation dtype;
               BF16_Optimizer all-reduces like stage 0); stage 3 the reduce bucket, two buckets with
               overlap_comm, plus the gathered parameters (largest module + 5e7 prefetched)
  activations  bytes saved for backward by each layer and by the loss head, per token, measured by
               autograd's saved-tensor hooks (fpscale.profiling.count_saved_bytes) on the real
               layer code at small sizes and fitted linear in tokens (and tokens x T: attention
               that saves T x T; a per-sequence term); the head, at the real vocabulary of a rank
               and either side of a chunk, also by its peak of live tensors in its own forward and
               backward (its transient: the logits, or one chunk of them)
  slack        ``allocated`` (the sum above: what the trainer's ``memory_gib``, torch's
               max_memory_allocated, measures) x 1.10 (the caching allocator's rounding and
               fragmentation) + 1 GiB outside it (CUDA context, cuBLAS and NCCL workspaces) = ``total``,
               what must fit the GPU

Activations follow the code: blocks run in the training dtype (bf16 weights under DeepSpeed bf16,
fp32 weights under autocast for the torch engine) on the CPU, one block of each distinct
``model.layers`` entry at the config's d_model (fpscale/train/memory_measure.py). What is not modelled:
the layers' own backward transients (one layer's backward at a time, smaller than the head's),
GPU-only kernels that save less than the CPU path (the Triton scan), sequence-parallel TP (the
activations of a TP rank are counted whole: an upper bound under TP, the head's logits / tp).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from fpscale.train.memory_measure import (  # noqa: F401  (the planner's measuring half, re-exported)
    CALIBRATION,
    UNROLL_CAPS,
    HeadFit,
    LayerFit,
    LivePeak,
    calibrate_head,
    calibrate_layer,
    measure_block,
)

GiB = 1024 ** 3
SLACK = 1.10                      # the allocator's rounding and fragmentation, on the whole
CONTEXT_GIB = 1.0                 # CUDA context, cuBLAS / NCCL workspaces: outside torch's allocator
DS_BUCKET = int(5e8)              # DeepSpeed's reduce_bucket_size and allgather_bucket_size defaults
DS_PREFETCH = int(5e7)            # stage3_prefetch_bucket_size default


# -- measuring: fpscale/train/memory_measure.py; the engine ----------------------------------
def plan_engine(cfg, gpus: int) -> str:
    """The engine a job of ``gpus`` processes runs (fpscale.parallel.state.resolve_engine): auto is
    DeepSpeed for several, torch's AdamW for one (a one-GPU job under the ``deepspeed`` launcher
    runs DeepSpeed: plan it with engine="deepspeed", fpscale-plan --engine deepspeed)."""
    engine = cfg.parallel.engine
    return ("deepspeed" if gpus > 1 else "torch") if engine == "auto" else engine


# -- model states ---------------------------------------------------------------------------
def parameter_counts(cfg) -> tuple[int, int, int]:
    """(parameters of the whole model, of one TP rank, of the largest module of one rank),
    counted on the meta device (nothing allocated)."""
    from fpscale.models import build_model
    tp = cfg.parallel.tp
    with torch.device("meta"):
        model = build_model(cfg)
    total = sum(dict((id(p), p.numel()) for p in model.parameters()).values())
    split: dict[int, int] = {}
    for module in model.layers.modules():
        if hasattr(module, "tp_plan"):
            for name in module.tp_plan():
                split[id(getattr(module, name))] = tp
    split[id(model.embed.weight)] = tp
    if model.lm_head is not None:
        split[id(model.lm_head)] = tp
    per_rank = sum(p.numel() // split.get(id(p), 1) for p in dict((id(p), p) for p in model.parameters()).values())
    largest = max(sum(p.numel() // split.get(id(p), 1) for p in m.parameters(recurse=False))
                  for m in model.modules())
    return total, per_rank, largest


@dataclass
class ModelStates:
    weights: float
    gradients: float
    optimizer: float
    buffers: float
    grad_dtype: str          # the dtype gradients are accumulated in
    params_per_rank: int
    largest_module: int


def model_states(cfg, dp: int, engine: str = "deepspeed") -> ModelStates:
    """Weights, gradients, optimizer states and DeepSpeed's buffers of one GPU (module docstring).
    ``engine="torch"``: one process with torch's AdamW, fp32 weights and gradients (bf16 autocast)
    and two fp32 moments, no master copy and no buffers: 16 bytes a parameter."""
    from fpscale.train.config import BatchPlan
    from fpscale.train.deepspeed_config import deepspeed_config
    if engine == "torch":
        _, P, largest = parameter_counts(cfg)
        return ModelStates(P * 4, P * 4, P * 8, 0, "fp32", P, largest)
    stage, bf16 = cfg.parallel.zero_stage, cfg.train.precision == "bf16"
    ds = deepspeed_config(cfg, BatchPlan(dp, 1, 1, dp))
    fp32_accum = not bf16 or ds.get("data_types", {}).get("grad_accum_dtype") == "fp32"
    comm = 4 if (not bf16 or ds.get("communication_data_type") == "fp32") else 2
    _, P, largest = parameter_counts(cfg)
    w = 2 if bf16 else 4
    part = P / dp
    if stage == 0:
        weights, grads = P * w, P * w + (P * 4 if bf16 else 0)
        optim = P * 8 + (P * 4 if bf16 else 0)
        buffers = min(P, DS_BUCKET) * comm
    elif stage == 1:
        weights, optim = P * w, part * 12
        if bf16 and fp32_accum:        # BF16_Optimizer: a whole fp32 gradient buffer + the bf16 grads
            grads, buffers = P * 6, min(P, DS_BUCKET) * comm
        else:
            grads, buffers = P * w + (part * 4 if bf16 else 0), DS_BUCKET * (4 if fp32_accum else w)
    else:
        weights = P * w / (dp if stage == 3 else 1)
        optim = part * 12
        grads = part * 4 if fp32_accum else part * (w + 4)
        accum = 4 if fp32_accum else w
        buffers = DS_BUCKET * max(accum, comm) * (2 if stage == 3 else 1)
        if stage == 3:
            buffers += (largest + DS_PREFETCH) * w
    return ModelStates(weights, grads, optim, buffers, "fp32" if fp32_accum else "bf16", P, largest)


# -- the plan -------------------------------------------------------------------------------
@dataclass
class Plan:
    engine: str               # "deepspeed" or "torch" (plan_engine)
    gpus: int
    gpu_memory_gib: float
    tp: int
    dp: int
    seq_len: int
    vocab_per_rank: int
    states: ModelStates
    layers: list[LayerFit]
    head: HeadFit
    unroll_layers: list[LayerFit] = field(default_factory=list)   # the same stack, unrolled backward
    zero_stage: int = 0

    def activations(self, B: int, unroll: bool = False) -> dict[str, float]:
        """Bytes by part at micro-batch B: each layer type's saved bytes, the head's saved and peak."""
        out: dict[str, float] = {}
        for fit in (self.unroll_layers if unroll and self.unroll_layers else self.layers):
            out[fit.kind] = out.get(fit.kind, 0.0) + fit.count * fit.bytes(B, self.seq_len)
        n = B * self.seq_len
        out["head (saved)"] = self.head.bytes("saved", n)
        out["head (peak)"] = max(self.head.bytes("peak", n), out["head (saved)"])
        return out

    def allocated(self, B: int, unroll: bool = False) -> float:
        """Bytes torch's caching allocator holds at its peak at micro-batch B: what the trainer's
        ``memory_gib`` reports on a GPU (torch.cuda.max_memory_allocated), no slack, no context."""
        s = self.states
        act = self.activations(B, unroll)
        layers = sum(v for k, v in act.items() if not k.startswith("head"))
        return s.weights + s.gradients + s.optimizer + s.buffers + layers + act["head (peak)"]

    def total(self, B: int, unroll: bool = False) -> float:
        """Bytes one GPU needs at micro-batch B: ``allocated`` x SLACK (the allocator's rounding and
        fragmentation: reserved beyond allocated) + the CUDA context, outside torch's allocator."""
        return SLACK * self.allocated(B, unroll) + CONTEXT_GIB * GiB

    def fits(self, B: int, unroll: bool = False) -> bool:
        return self.total(B, unroll) <= self.gpu_memory_gib * GiB

    def largest_micro_batch(self, unroll: bool = False, limit: int = 4096, divides: int = 0) -> int:
        """The largest B (<= limit; dividing ``divides`` when given) that fits, 0 if none."""
        best = 0
        for B in range(1, limit + 1):
            if not self.fits(B, unroll):
                break
            if not divides or divides % B == 0:
                best = B
        return best

    def to_dict(self, micro_batches: list[int]) -> dict:
        s = self.states
        out = {"engine": self.engine, "zero_stage": self.zero_stage if self.engine == "deepspeed" else None,
               "gpus": self.gpus, "tp": self.tp, "dp": self.dp,
               "gpu_memory_gib": self.gpu_memory_gib,
               "seq_len": self.seq_len, "slack": SLACK, "context_gib": CONTEXT_GIB,
               "params_per_rank": s.params_per_rank, "grad_accum_dtype": s.grad_dtype,
               "gib": {"weights": s.weights / GiB, "gradients": s.gradients / GiB, "optimizer": s.optimizer / GiB,
                       "buffers": s.buffers / GiB},
               "layers": [dataclasses.asdict(f) for f in self.layers],
               "unroll_layers": [dataclasses.asdict(f) for f in self.unroll_layers],
               "micro_batches": {}}
        for unroll in ([False, True] if self.unroll_layers else [False]):
            key = "unroll" if unroll else "configured"
            out["largest_micro_batch" + ("_unroll" if unroll else "")] = self.largest_micro_batch(unroll)
            out["micro_batches"][key] = {str(B): {**{k: v / GiB for k, v in self.activations(B, unroll).items()},
                                                  "allocated": self.allocated(B, unroll) / GiB,
                                                  "total": self.total(B, unroll) / GiB, "fits": self.fits(B, unroll)}
                                         for B in micro_batches}
        return out


def plan(cfg, gpus: int, gpu_memory_gib: float, unroll: bool = True, engine: str | None = None) -> Plan:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory_gib`` each. ``unroll``: also the
    stack with every fixed-point layer on the unrolled backward at its cap (where it differs).
    ``engine``: who trains (default: ``plan_engine``, as the trainer resolves parallel.engine).
    Each distinct block (a ``model.layers`` entry, ``repeat`` aside) is calibrated once."""
    from fpscale.errors import UserError
    tp = cfg.parallel.tp
    if gpus < 1 or gpus % tp:
        raise UserError(f"--gpus {gpus} must be a positive multiple of parallel.tp = {tp}")
    if gpu_memory_gib <= 0:
        raise UserError(f"the GPU memory must be > 0 GiB, got {gpu_memory_gib}")
    engine = engine or plan_engine(cfg, gpus)
    if engine == "torch" and gpus > 1:
        raise UserError(f"the torch engine trains one process, not {gpus}: plan --engine deepspeed (or auto)")
    fits: dict[tuple[str, bool], LayerFit] = {}

    def fit(spec, unrolled: bool = False) -> LayerFit:
        key = (repr(dataclasses.replace(spec, repeat=1)), unrolled)
        if key not in fits:
            fits[key] = calibrate_layer(cfg, spec, unrolled, engine)
        return dataclasses.replace(fits[key], count=spec.repeat)

    layers = [fit(spec) for spec in cfg.model.layers]
    unrolled = []
    if unroll and any(spec.looped for spec in cfg.model.layers):
        unrolled = [fit(spec, True) if spec.looped else f for spec, f in zip(cfg.model.layers, layers)]
        if all(a.mode == b.mode for a, b in zip(layers, unrolled)):
            unrolled = []
    vocab = math.ceil(cfg.model.vocab_size / tp)
    return Plan(engine, gpus, gpu_memory_gib, tp, gpus // tp, cfg.data.seq_len, vocab,
                model_states(cfg, gpus // tp, engine), layers, calibrate_head(cfg, vocab, engine=engine), unrolled,
                cfg.parallel.zero_stage)


def auto_micro_batch(cfg, dp_size: int, device: torch.device, engine: str | None = None) -> int:
    """``train.micro_batch: auto``: the largest micro-batch that divides each rank's share of the
    global batch and fits this device (``train.gpu_memory_gib``, else the GPU's own memory), for
    the engine that trains (the trainer's ``state.engine``)."""
    from fpscale.errors import ConfigError
    gib = cfg.train.gpu_memory_gib
    if not gib:
        if device.type != "cuda":
            raise ConfigError("train.micro_batch", "auto needs the device memory: on a CPU set "
                              "train.gpu_memory_gib (the budget to plan for) or give a number")
        gib = torch.cuda.get_device_properties(device).total_memory / GiB
    share = cfg.train.global_batch // dp_size
    p = plan(cfg, dp_size * cfg.parallel.tp, gib, unroll=False, engine=engine)
    best = p.largest_micro_batch(limit=share, divides=share)
    if best == 0:
        raise ConfigError("train.micro_batch", f"auto: not even micro-batch 1 fits {gib:.1f} GiB "
                          f"(the plan needs {p.total(1) / GiB:.1f} GiB: fpscale-plan shows the parts)")
    return best
