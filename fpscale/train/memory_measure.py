"""The measuring half of the memory planner (fpscale.train.memory_plan): the bytes each
``model.layers`` entry and the loss head save for backward, measured by autograd's saved-tensor
hooks on the real layer code at small sizes (CALIBRATION) and fitted linear in tokens; the head at
the real vocabulary under torch's FakeTensorMode (shapes and dtypes, nothing computed). The
weights' dtype and autocast follow the engine that trains (DeepSpeed bf16: bf16 weights; torch:
fp32 weights under bf16 autocast)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fpscale.profiling import count_saved_bytes, storage_key

CALIBRATION = ((1, 64), (2, 64), (1, 128), (2, 128))   # (B, T) each layer's per-token fit is measured at
UNROLL_CAPS = (2, 4)              # solver caps the unrolled backward's per-iteration bytes are fitted on


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
            if isinstance(t, torch.Tensor):
                key, nbytes = storage_key(t)          # meta tensors too: the head is measured there
                if nbytes and key not in self._seen:
                    self._seen[key] = nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key)
        return out


def _dtype(cfg, engine: str = "deepspeed") -> torch.dtype:
    """The weights' dtype: bf16 under DeepSpeed bf16; fp32 under the torch engine (autocast)."""
    return torch.bfloat16 if cfg.train.precision == "bf16" and engine != "torch" else torch.float32


def _autocast(cfg, engine: str):
    """The torch engine's bf16 autocast (fpscale.train.precision), on the CPU the plan measures on."""
    if engine == "torch" and cfg.train.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def _build_block(cfg, spec, engine: str = "deepspeed"):
    from fpscale.layers.registry import LayerSpec  # noqa: F401  (the registry is loaded by config)
    solver = cfg.solver.with_overrides(spec.solver, "model.layers") if spec.looped else None
    torch.manual_seed(cfg.seed)
    block = spec.build(cfg.model, solver).to(_dtype(cfg, engine))
    return block.train()


def _loops(block):
    from fpscale.layers.fixed_point import FixedPointLayer
    return [m for m in block.modules() if isinstance(m, FixedPointLayer)]


def measure_block(block, B: int, T: int, dtype: torch.dtype, d: int, autocast=None) -> tuple[int, int]:
    """(saved bytes, solver iterations taken) of one training forward of ``block`` on [B, T, d]."""
    torch.manual_seed(0)
    x = torch.randn(B, T, d, dtype=dtype, requires_grad=True)
    with count_saved_bytes(exclude=tuple(block.parameters())) as saved, autocast or contextlib.nullcontext():
        block(x, 0, None)
    iters = max((m.last_stats.iterations for m in _loops(block) if m.last_stats is not None), default=0)
    return saved.total, iters


def calibrate_layer(cfg, spec, unroll: bool = False, engine: str = "deepspeed") -> LayerFit:
    """Fit one ``model.layers`` entry. ``unroll``: its fixed-point solves with the unrolled
    backward at the configured cap (solver.max_iter), from two small caps run to the end."""
    block = _build_block(cfg, spec, engine)
    dtype, d = _dtype(cfg, engine), cfg.model.d_model
    loops = _loops(block)
    mode = loops[0].backward_mode if loops else "-"
    if unroll or mode == "unroll":
        if not loops or all(m.iterate_free for m in loops):
            return dataclasses.replace(calibrate_layer(cfg, spec, engine=engine), mode="unroll" if loops else "-")
        cap = max(m.solver.max_iter for m in loops)
        B, T = CALIBRATION[-1]
        rows, vals = [], []
        for k in UNROLL_CAPS:
            for m in loops:
                m.solver = dataclasses.replace(m.solver, backward="unroll", tol=0.0, stop_quantile=0.0)
                m.cap = k
            saved, iters = measure_block(block, B, T, dtype, d, _autocast(cfg, engine))
            rows.append((1.0, float(iters)))
            vals.append(saved / (B * T))
        if rows[0][1] == rows[1][1]:
            raise RuntimeError(f"{spec.type}: the unrolled solves stopped before their caps {UNROLL_CAPS}")
        base, per_iter = _fit(rows, vals)
        return LayerFit(spec.type, spec.repeat, "unroll", base, 0.0, cap, per_iter)
    rows, vals = [], []
    for B, T in CALIBRATION:
        saved, _ = measure_block(block, B, T, dtype, d, _autocast(cfg, engine))
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


def calibrate_head(cfg, vocab: int, device: str = "fake", engine: str = "deepspeed") -> HeadFit:
    """Measured at the real ``vocab`` (the logits decide), at token counts either side of a chunk.
    ``fake`` (the default): under torch's FakeTensorMode, CPU tensors that hold no data (real shapes,
    dtypes and autocast, nothing computed: the head at a 50k vocabulary took minutes of one CPU
    thread in bf16); ``cpu`` computes it (tests/train/test_memory_plan.py: both give the same fit)."""
    from fpscale.layers.registry import layer_spec
    chunk = int(getattr(cfg.model, "loss_chunk", 0) or 0)
    points = [chunk // 2, chunk, 2 * chunk] if chunk else [512, 1024, 2048]
    small = copy.deepcopy(cfg)
    small.model.vocab_size = vocab
    small.model.layers = [layer_spec("attn")]
    from fpscale.models import build_model
    torch.manual_seed(0)
    if device == "fake":          # values never read: allocated, not initialised (the 50k x d init took seconds)
        with torch.device("meta"):
            model = build_model(small)
        model = model.to_empty(device="cpu")
    else:
        model = build_model(small)
    model = model.to(_dtype(cfg, engine)).train()
    model.layers, model.layer_types = torch.nn.ModuleList(), []
    mode, params = contextlib.nullcontext(), tuple(model.parameters())
    if device == "fake":          # the real weights enter as fake tensors (allow_non_fake_inputs), one each
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        params += tuple(mode.from_tensor(p) for p in params)       # memoised: what the ops will see
    with mode, _autocast(cfg, engine):
        rows, saved_vals, peak_vals = _measure_head(model, params, vocab, chunk, points, cfg.model.max_seq_len)
    if chunk:
        return HeadFit(tuple(_fit(rows, saved_vals)), tuple(_fit(rows, peak_vals)), chunk)
    (a, c), (pa, pc) = _fit(rows, saved_vals), _fit(rows, peak_vals)
    return HeadFit((a, 0.0, c), (pa, 0.0, pc), 0)


def _measure_head(model, params: tuple, vocab: int, chunk: int, points: list[int],
                  max_seq_len: int) -> tuple[list, list, list]:
    """(fit rows, saved bytes, peak bytes) of the head at each token count; ``params`` live anyway."""
    rows, saved_vals, peak_vals = [], [], []
    for n in points:
        rows_of = min(64, max_seq_len)           # the head is per token: any [B, T] of N
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
    return rows, saved_vals, peak_vals
