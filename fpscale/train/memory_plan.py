"""What one GPU holds in a training step, predicted before a job queues; the largest micro-batch
that fits a memory budget.

    fpscale-plan --config configs/125m_fpmamba.yaml --gpus 8 --gpu-memory 40      # a table
    python launch/plan.py --config configs/125m_fpsa.yaml --gpus 16 --gpu-memory 80 --json
    plan = memory_plan.plan(cfg, gpus=8, gpu_memory_gib=40)       # in code: Plan.fits(B), .largest_micro_batch()

Per GPU, with P the parameters of one tensor-parallel rank and D = gpus / parallel.tp the
data-parallel size (fpscale hands torch's AdamW to DeepSpeed; ``trainer.deepspeed_config`` says
whether bf16 gradients are accumulated and reduced in fp32):

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
  slack        x 1.10 on the whole (the caching allocator's rounding and fragmentation), plus
               1 GiB outside it (CUDA context, cuBLAS and NCCL workspaces)

Activations follow the code: blocks run in the training dtype (bf16 weights under DeepSpeed bf16)
on the CPU, one block of each ``model.layers`` entry at the config's d_model. What is not modelled:
the layers' own backward transients (one layer's backward at a time, smaller than the head's),
GPU-only kernels that save less than the CPU path (the Triton scan), sequence-parallel TP (the
activations of a TP rank are counted whole: an upper bound under TP, the head's logits / tp).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fpscale.profiling import count_saved_bytes

GiB = 1024 ** 3
SLACK = 1.10                      # the allocator's rounding and fragmentation, on the whole
CONTEXT_GIB = 1.0                 # CUDA context, cuBLAS / NCCL workspaces: outside torch's allocator
DS_BUCKET = int(5e8)              # DeepSpeed's reduce_bucket_size and allgather_bucket_size defaults
DS_PREFETCH = int(5e7)            # stage3_prefetch_bucket_size default
CALIBRATION = ((1, 64), (2, 64), (1, 128), (2, 128))   # (B, T) each layer's per-token fit is measured at
UNROLL_CAPS = (2, 4)              # solver caps the unrolled backward's per-iteration bytes are fitted on


# -- measuring ------------------------------------------------------------------------------
class LivePeak(TorchDispatchMode):
    """Peak bytes of the tensors that ops create inside the block (forward and backward), storages
    counted once; a storage counts until the tensor that created it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = s.data_ptr()
                if key and key not in self._seen:
                    self._seen[key] = s.nbytes()
                    self.live += s.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key)
        return out


def _dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def _fit(points: list[tuple[float, ...]], values: list[float]) -> list[float]:
    """Least squares (exact for as many points as terms)."""
    a = torch.tensor(points, dtype=torch.float64)
    b = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()


@dataclass
class LayerFit:
    """Bytes one block of ``kind`` saves for backward: per_token x N + per_token_T x N x T (+ the
    unrolled backward's per_iteration x N x iterations when ``iterations`` is set) + per_sequence x B."""
    kind: str
    count: int
    mode: str
    per_token: float
    per_token_T: float = 0.0
    iterations: int = 0            # the unrolled backward at this cap (0: not iteration-dependent)
    per_iteration: float = 0.0
    per_sequence: float = 0.0      # per-sample state (the solver's per-sample flags and damping)

    def bytes(self, B: int, T: int) -> float:
        n = B * T
        return max(0.0, n * (self.per_token + self.per_token_T * T + self.per_iteration * self.iterations)
                   + B * self.per_sequence)


def _build_block(cfg, spec):
    from fpscale.layers.registry import LayerSpec  # noqa: F401  (the registry is loaded by config)
    solver = cfg.solver.with_overrides(spec.solver, "model.layers") if spec.looped else None
    torch.manual_seed(cfg.seed)
    block = spec.build(cfg.model, solver).to(_dtype(cfg))
    return block.train()


def _loops(block):
    from fpscale.layers.fixed_point import FixedPointLayer
    return [m for m in block.modules() if isinstance(m, FixedPointLayer)]


def measure_block(block, B: int, T: int, dtype: torch.dtype, d: int) -> tuple[int, int]:
    """(saved bytes, solver iterations taken) of one training forward of ``block`` on [B, T, d]."""
    torch.manual_seed(0)
    x = torch.randn(B, T, d, dtype=dtype, requires_grad=True)
    with count_saved_bytes(exclude=tuple(block.parameters())) as saved:
        block(x, 0, None)
    iters = max((m.last_stats.iterations for m in _loops(block) if m.last_stats is not None), default=0)
    return saved.total, iters


def calibrate_layer(cfg, spec, unroll: bool = False) -> LayerFit:
    """Fit one ``model.layers`` entry. ``unroll``: its fixed-point solves with the unrolled
    backward at the configured cap (solver.max_iter), from two small caps run to the end."""
    block = _build_block(cfg, spec)
    dtype, d = _dtype(cfg), cfg.model.d_model
    loops = _loops(block)
    mode = loops[0].backward_mode if loops else "-"
    if unroll or mode == "unroll":
        if not loops or all(m.iterate_free for m in loops):
            return dataclasses.replace(calibrate_layer(cfg, spec), mode="unroll" if loops else "-")
        cap = max(m.solver.max_iter for m in loops)
        B, T = CALIBRATION[-1]
        rows, vals = [], []
        for k in UNROLL_CAPS:
            for m in loops:
                m.solver = dataclasses.replace(m.solver, backward="unroll", tol=0.0, stop_quantile=0.0)
                m.cap = k
            saved, iters = measure_block(block, B, T, dtype, d)
            rows.append((1.0, float(iters)))
            vals.append(saved / (B * T))
        if rows[0][1] == rows[1][1]:
            raise RuntimeError(f"{spec.type}: the unrolled solves stopped before their caps {UNROLL_CAPS}")
        base, per_iter = _fit(rows, vals)
        return LayerFit(spec.type, spec.repeat, "unroll", base, 0.0, cap, per_iter)
    rows, vals = [], []
    for B, T in CALIBRATION:
        saved, _ = measure_block(block, B, T, dtype, d)
        rows.append((B * T, B, 1.0))
        vals.append(saved)
    per_token, per_sequence, const = _fit(rows, vals)
    worst = max(abs(n * per_token + b * per_sequence + const - v) / v for (n, b, _), v in zip(rows, vals))
    if worst > 0.02:           # not linear in tokens: a T x T term too (attention saving its scores)?
        rows_T = [(n, n * T, b, 1.0) for (n, b, _), (_, T) in zip(rows, CALIBRATION)]
        fit_T = _fit(rows_T, vals)
        if fit_T[1] > 0:       # only a growing term; a shrinking one is no T x T (keep the linear fit)
            return LayerFit(spec.type, spec.repeat, mode, fit_T[0], fit_T[1], per_sequence=fit_T[2])
    return LayerFit(spec.type, spec.repeat, mode, per_token, per_sequence=per_sequence)


@dataclass
class HeadFit:
    """The loss head (final norm, output layer, cross-entropy, through ``LoopedLM.forward``) at the
    vocabulary of one TP rank: ``saved`` and ``peak`` bytes = a x N + c x min(N, chunk) + const,
    chunk ``model.loss_chunk`` (0: no chunks, the head is linear in N)."""
    saved: tuple[float, float, float]
    peak: tuple[float, float, float]
    chunk: int

    def bytes(self, which: str, n: int) -> float:
        a, c, const = getattr(self, which)
        return max(0.0, a * n + c * min(n, self.chunk or n) + const)


def calibrate_head(cfg, vocab: int) -> HeadFit:
    """Measured at the real ``vocab`` (the logits decide), at token counts either side of a chunk."""
    from fpscale.layers.registry import layer_spec
    from fpscale.models import build_model
    chunk = int(getattr(cfg.model, "loss_chunk", 0) or 0)
    points = [chunk // 2, chunk, 2 * chunk] if chunk else [512, 1024, 2048]
    rows, saved_vals, peak_vals = [], [], []
    small = copy.deepcopy(cfg)
    small.model.vocab_size = vocab
    small.model.layers = [layer_spec("attn")]
    torch.manual_seed(0)
    model = build_model(small).to(_dtype(cfg)).train()
    model.layers, model.layer_types = torch.nn.ModuleList(), []
    params = tuple(model.parameters())
    for n in points:
        rows_of = min(64, cfg.model.max_seq_len)           # the head is per token: any [B, T] of N
        n = -(-n // rows_of) * rows_of
        tokens = torch.randint(0, vocab, (n // rows_of, rows_of))
        targets = torch.randint(0, vocab, (n // rows_of, rows_of))
        model.zero_grad(set_to_none=True)
        with LivePeak() as live:
            with count_saved_bytes(exclude=params) as saved:
                loss = model(tokens, targets=targets)
            loss.backward()
        rows.append((n, min(n, chunk or n), 1.0) if chunk else (n, 1.0))
        saved_vals.append(saved.total)
        peak_vals.append(live.peak - sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None))
    if chunk:
        return HeadFit(tuple(_fit(rows, saved_vals)), tuple(_fit(rows, peak_vals)), chunk)
    (a, c), (pa, pc) = _fit(rows, saved_vals), _fit(rows, peak_vals)
    return HeadFit((a, 0.0, c), (pa, 0.0, pc), 0)


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


def model_states(cfg, dp: int) -> ModelStates:
    """Weights, gradients, optimizer states and DeepSpeed's buffers of one GPU (module docstring)."""
    from fpscale.train.config import BatchPlan
    from fpscale.train.deepspeed_config import deepspeed_config
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

    def activations(self, B: int, unroll: bool = False) -> dict[str, float]:
        """Bytes by part at micro-batch B: each layer type's saved bytes, the head's saved and peak."""
        out: dict[str, float] = {}
        for fit in (self.unroll_layers if unroll and self.unroll_layers else self.layers):
            out[fit.kind] = out.get(fit.kind, 0.0) + fit.count * fit.bytes(B, self.seq_len)
        n = B * self.seq_len
        out["head (saved)"] = self.head.bytes("saved", n)
        out["head (peak)"] = max(self.head.bytes("peak", n), out["head (saved)"])
        return out

    def total(self, B: int, unroll: bool = False) -> float:
        """Bytes one GPU needs at micro-batch B, slack and context included."""
        s = self.states
        act = self.activations(B, unroll)
        layers = sum(v for k, v in act.items() if not k.startswith("head"))
        return SLACK * (s.weights + s.gradients + s.optimizer + s.buffers + layers + act["head (peak)"]) \
            + CONTEXT_GIB * GiB

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
        out = {"gpus": self.gpus, "tp": self.tp, "dp": self.dp, "gpu_memory_gib": self.gpu_memory_gib,
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
                                                  "total": self.total(B, unroll) / GiB, "fits": self.fits(B, unroll)}
                                         for B in micro_batches}
        return out


def plan(cfg, gpus: int, gpu_memory_gib: float, unroll: bool = True) -> Plan:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory_gib`` each. ``unroll``: also the
    stack with every fixed-point layer on the unrolled backward at its cap (where it differs)."""
    from fpscale.errors import UserError
    tp = cfg.parallel.tp
    if gpus < 1 or gpus % tp:
        raise UserError(f"--gpus {gpus} must be a positive multiple of parallel.tp = {tp}")
    if gpu_memory_gib <= 0:
        raise UserError(f"the GPU memory must be > 0 GiB, got {gpu_memory_gib}")
    layers = [calibrate_layer(cfg, spec) for spec in cfg.model.layers]
    unrolled = []
    if unroll and any(spec.looped for spec in cfg.model.layers):
        unrolled = [calibrate_layer(cfg, spec, unroll=True) if spec.looped else fit
                    for spec, fit in zip(cfg.model.layers, layers)]
        if all(a.mode == b.mode for a, b in zip(layers, unrolled)):
            unrolled = []
    return Plan(gpus, gpu_memory_gib, tp, gpus // tp, cfg.data.seq_len, math.ceil(cfg.model.vocab_size / tp),
                model_states(cfg, gpus // tp), layers, calibrate_head(cfg, math.ceil(cfg.model.vocab_size / tp)),
                unrolled)


def auto_micro_batch(cfg, dp_size: int, device: torch.device) -> int:
    """``train.micro_batch: auto``: the largest micro-batch that divides each rank's share of the
    global batch and fits this device (``train.gpu_memory_gib``, else the GPU's own memory)."""
    from fpscale.errors import ConfigError
    gib = cfg.train.gpu_memory_gib
    if not gib:
        if device.type != "cuda":
            raise ConfigError("train.micro_batch", "auto needs the device memory: on a CPU set "
                              "train.gpu_memory_gib (the budget to plan for) or give a number")
        gib = torch.cuda.get_device_properties(device).total_memory / GiB
    share = cfg.train.global_batch // dp_size
    p = plan(cfg, dp_size * cfg.parallel.tp, gib, unroll=False)
    best = p.largest_micro_batch(limit=share, divides=share)
    if best == 0:
        raise ConfigError("train.micro_batch", f"auto: not even micro-batch 1 fits {gib:.1f} GiB "
                          f"(the plan needs {p.total(1) / GiB:.1f} GiB: fpscale-plan shows the parts)")
    return best
