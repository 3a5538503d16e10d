"""`SolverConfig`: every knob of the fixed-point solver and its backward pass, in four parts.

    solver: {forward: {max_iter: 16, tol: 2.0e-2}, adjoint: {backward: implicit}, execution: {chunk: 4}}
    cfg = SolverConfig(tol=1e-4, chunk=4)         # flat names place themselves: cfg.forward.tol == cfg.tol

Each field lives in exactly one part (``PART_OF``, the one table); ``cfg.tol`` reads ``cfg.forward.tol``
(read-only: write ``cfg.forward.tol``). Flat keys in YAML, overrides and saved configs (``solver.tol``, the
form before the parts) load with one ``ConfigDeprecation`` per key naming the new key (``SolverConfig.upgrade``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fpscale.errors import check

BackwardMode = Literal["implicit", "neumann1", "phantom", "jfb", "unroll"]
IMPLICIT_MODES = ("implicit", "neumann1")       # the modes with an adjoint at z* (one f under grad)


@dataclass
class ForwardConfig:
    """``solver.forward``: how the fixed point ``z = f(z)`` is found (Algorithm 1 of FPRM, seed 004, plus the
    quantile stop of its App. D).

      max_iter           hard cap on applications of f in training
      eval_max_iter      the cap in evaluation (model.eval()); 0 = max_iter. The seeds evaluate
                         with more iterations than they train with (FPRM: 256 vs 128)
      tol                a sample is converged when the relative residual of each of its tokens
                         is below tol (raised to what the map's dtype resolves: solvers.precision)
      norm               ``inf`` (default) or ``l2`` relative residual per token, or ``sample_l2``: one
                         residual per sample, ||f(z) - z||_2 / ||z||_2 over the whole sample (every
                         token and channel), in float32 against the previous iterate z, as
                         jacobfa/Attractor does (attractor/models/attractor/solvers.py:4-9);
                         fpscale.solvers.anderson.sample_residual
      min_iter           no convergence (quantile) stop before this many applications of f (the
                         non-finite stop still applies); clipped to the cap, as Attractor does
                         (attractor.py:340)
      stop_quantile      p: in training, stop once at most floor(p * B) of the B samples of the
                         micro-batch are unconverged (75% converged at the seeds' p = 0.25);
                         evaluation always uses p = 0 (every sample converged). p * B < 1 is the
                         same rule as p = 0: ``fpscale.Config`` warns about it, naming the key
      decisions          token (default) | sample: the unit that Algorithm 1's damping, patience and
                         freezing act on. token: each token has its own eta, best residual and
                         patience, driven by its own residual, and retires (is frozen) once it
                         converged or its eta fell below eta_min: a causal f then gives token t an
                         output that depends on tokens <= t only, converged or not, and cached
                         decoding repeats the full forward's iterates (docs/solver.md, "Causality").
                         sample: the seeds' rule (FPRM Algorithm 1 per sample, as the FP-RNN
                         authors' solver keeps it): one eta per sample, driven by its largest token
                         residual, so a stalled later token damps earlier ones; for non-causal maps
      damping            initial eta of the damped step z <- eta f(z) + (1 - eta) z
      patience, decay    after ``patience`` steps without a new best residual of a unit (token or
                         sample), its eta <- decay * eta (patience 0 disables the decay)
      eta_min            stop when every unconverged sample's eta fell below this
      freeze_converged   per-token selective update (FPSA): a converged token is frozen (always so
                         with ``decisions: token``; this key matters with ``sample``)
      anderson           Anderson acceleration window (0 = off, else >= 2)
      anderson_lambda    Tikhonov regularisation of Anderson's least squares
      eps                the floor of a residual's denominator: ||f(z) - z|| / (||z|| + eps)
      agree              rank (default) | dp: in training, each data-parallel rank stops its solves on
                         its own micro-batch (every optimizer step waits for the slowest rank), or
                         the stop decision (quantile, stall, non-finite) is taken over the DP group's
                         samples as one process would over all of them: equal work on every rank, one
                         3-int all-reduce over DP per iteration (forward and adjoint). Evaluation
                         and decoding always stop per rank
    """

    max_iter: int = 30
    eval_max_iter: int = 0
    tol: float = 1e-2
    norm: Literal["inf", "l2", "sample_l2"] = "inf"
    min_iter: int = 0
    stop_quantile: float = 0.25
    decisions: Literal["token", "sample"] = "token"
    damping: float = 1.0
    patience: int = 5
    decay: float = 0.7
    eta_min: float = 0.05
    freeze_converged: bool = False
    anderson: int = 0
    anderson_lambda: float = 1e-4
    eps: float = 1e-6
    agree: Literal["rank", "dp"] = "rank"


@dataclass
class AdjointConfig:
    """``solver.adjoint``: how a solve is differentiated (docs/solver.md, "Backward modes").

      backward           implicit | neumann1 | phantom | jfb | unroll. neumann1: the adjoint is one
                         Neumann term, u = g + J^T g, with no masking, no damping and no tolerance
                         (Attractor's ``onestep``, attractor.py:65-70)
      phantom_steps      k differentiable steps from z* for ``phantom`` (jfb is k = 1)
      eval_output        step (default) | iterate: what a solve outputs with grad off. step: what the
                         grad-mode forward outputs at the same iterate, whatever the grad mode (jfb:
                         f(z*), phantom: f^k(z*), k = phantom_steps; implicit and unroll output z*
                         in both modes). iterate: z* with grad off (k fewer applications of f per
                         evaluation solve; a jfb/phantom model is then evaluated on a function the
                         optimizer never saw: the behaviour before issue 36)
      backward_max_iter, backward_tol
                         stopping of the adjoint solve u = J^T u + g (implicit only)
      backward_min_iter  min_iter of the adjoint solve (implicit only)
      backward_freeze    implicit: the selective update in the adjoint solve: an adjoint entry (token,
                         or fpsa's (token, head)) whose residual fell below backward_tol is frozen,
                         as the forward's ``freeze_converged`` freezes (seed 000, App. C.3). Off: the
                         adjoint updates every entry until it stops
      adjoint_step       grad (default) | vjp: the implicit adjoint's step as ``torch.autograd.grad`` of the
                         recorded f(z*) (eager: dynamo does not trace it) or as ``torch.func.vjp`` of f at z*,
                         linearised once per chunk, which a chunked adjoint compiles (fpscale.solvers.backward.
                         VjpStep; not with the CUDA Triton scan: fpmamba on a GPU). Not yet measured on a GPU
      mask_unconverged   implicit: tokens that did not converge get no adjoint (seed 000, App. D); with
                         tol 0 (a fixed depth: none converges) only non-finite samples are masked
    """

    backward: BackwardMode = "implicit"
    phantom_steps: int = 4
    eval_output: Literal["step", "iterate"] = "step"
    backward_max_iter: int = 40
    backward_tol: float = 1e-4
    backward_min_iter: int = 0
    backward_freeze: bool = False
    adjoint_step: Literal["grad", "vjp"] = "grad"
    mask_unconverged: bool = True


@dataclass
class ExecutionConfig:
    """``solver.execution``: how the iterations run (speed only: the same iterates in every setting).

      bookkeeping        auto | fused | torch: the iteration's residual, flags, damping, freezing and
                         damped step as 4 Triton kernels (fpscale.solvers.fused) or as about 40
                         PyTorch ops. auto (default): fused on CUDA where Triton imports. Solves with
                         autograd through the loop (unroll's training solve) or Anderson stay torch
      compile            torch.compile the layer's iteration step (one application of f, with
                         dynamic=False); the iteration loop stays in Python, so a different
                         iteration count never recompiles. Off until measured on the target device
      chunk              K > 0: run the iterations in chunks of K, every stop / freeze / damping decision a
                         device mask, one host read per chunk, each chunk compiled as one graph where
                         it traces (fpscale.solvers.chunked; docs/solver.md). 0 (default): the loop
                         above (check_every, bookkeeping)
      chunk_schedule     fixed (default) | expected: with ``chunk`` > 0, when the host reads. fixed: after
                         every chunk. expected: a layer's solve launches the chunks that cover the iterations
                         its previous solve took before its first read, then reads after each chunk; with a
                         small chunk (1 or 2: one compiled graph of that many iterations) a solve computes
                         no masked iteration after its stop unless it stops earlier than the last one, and
                         still reads about once (not under ``agree: dp``, which reads every chunk)
      cuda_graph         with ``chunk`` > 0, on CUDA: each compiled chunk is captured as a CUDA graph and
                         replayed (torch.compile mode reduce-overhead: CUDA graph trees, static buffers per
                         geometry and dtype), so a chunk of K iterations is one graph launch. Needs a traced
                         chunk: not with backward unroll (its training solve runs under autograd), not under
                         tensor parallelism (f's collectives in the graph: not yet checked); on another device
                         an error at launch (fpscale.solvers.chunked.check_cuda_graph)
      check_every        read the stop decision on the host every N iterations (and at the cap);
                         the iterations between are valid further iterates and count. 1 (default):
                         every iteration. With no stop rule that can fire (tol 0, no eta_min stop
                         within the cap) the solve reads once, at its end, whatever N
    """

    bookkeeping: Literal["auto", "fused", "torch"] = "auto"
    compile: bool = False
    chunk: int = 0
    chunk_schedule: Literal["fixed", "expected"] = "fixed"
    cuda_graph: bool = False
    check_every: int = 1


@dataclass
class CompatConfig:
    """``solver.compat``: options that exist to reproduce a peer's solver; fpscale's defaults differ.

      anderson_variant   fpscale (default: lambda relative to the Gram's mean diagonal, the mixing
                         solved in float64, the mixed iterate returned) or attractor: jacobfa/Attractor's
                         (attractor/models/attractor/solvers.py:38-122): lambda absolute, the mixing
                         solved in float32, two plain steps before any mixing or stop test, the last
                         f(z) returned (fpscale.solvers.anderson)
      stop_residual      the residual the convergence test reads: ``current`` (this iteration's, default)
                         or ``best`` (each sample's lowest so far: the FP-RNN authors' solver,
                         dr-faustus/fp-rnn models/model_utils.py ``FixedPointOptimizer.step``;
                         fpscale.solvers.stop_rule)
    """

    anderson_variant: Literal["fpscale", "attractor"] = "fpscale"
    stop_residual: Literal["current", "best"] = "current"


PARTS: dict[str, type] = {"forward": ForwardConfig, "adjoint": AdjointConfig, "execution": ExecutionConfig,
                          "compat": CompatConfig}
PART_OF = {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}   # the one table


def key_of(name: str, prefix: str = "") -> str:
    """The nested key of a flat field name: ``key_of("tol", "solver") == "solver.forward.tol"``."""
    return ".".join(p for p in (prefix, PART_OF[name], name) if p)


@dataclass(init=False)
class SolverConfig:
    """How a fixed point ``z = f(z)`` is found and differentiated: its four parts, documented in their
    classes. ``SolverConfig(tol=1e-4, chunk=4)`` places each flat keyword in its part (``PART_OF``), so
    ``dataclasses.replace(cfg, tol=...)`` works; ``cfg.tol`` reads ``cfg.forward.tol``."""

    forward: ForwardConfig = field(default_factory=ForwardConfig)
    adjoint: AdjointConfig = field(default_factory=AdjointConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)

    def __init__(self, forward: ForwardConfig | None = None, adjoint: AdjointConfig | None = None,
                 execution: ExecutionConfig | None = None, compat: CompatConfig | None = None, **flat: Any):
        unknown = sorted(set(flat) - PART_OF.keys())
        if unknown:
            raise TypeError(f"SolverConfig got unexpected keyword argument(s) {', '.join(unknown)}")
        given = {"forward": forward, "adjoint": adjoint, "execution": execution, "compat": compat}
        for part, cls in PARTS.items():   # a copy of each part: replace(cfg, ...) never shares one
            mine = {k: v for k, v in flat.items() if PART_OF[k] == part}
            setattr(self, part, dataclasses.replace(given[part] or cls(), **mine))

    if TYPE_CHECKING:       # the flat read-only views below, generated from PART_OF
        def __getattr__(self, name: str) -> Any: ...

    @classmethod
    def upgrade(cls, data: dict, key: str) -> dict:
        """Flat keys (``solver.tol``, the form before the parts) move into their part with one
        ``ConfigDeprecation`` each; a key in the wrong part or misspelt is refused, naming it."""
        from fpscale.typed import nest
        return nest(data, PART_OF, key, owner=cls.__name__)

    def validate(self, prefix: str = "") -> None:
        """Every rule, one row each: (flat name, holds, the constraint); the error names the nested key."""
        s = self
        finite = ("tol", "backward_tol", "eps", "anderson_lambda", "eta_min")
        rules: list[tuple[str, bool, str]] = [
            ("max_iter", s.max_iter >= 1, f"must be >= 1, got {s.max_iter}"),
            ("eval_max_iter", s.eval_max_iter >= 0, f"must be >= 0 (0 = max_iter), got {s.eval_max_iter}"),
            *((n, math.isfinite(getattr(s, n)) and getattr(s, n) >= 0,
               f"must be a finite number >= 0, got {getattr(s, n)}") for n in finite),
            ("stop_quantile", 0.0 <= s.stop_quantile < 1.0,
             f"must lie in [0, 1) (the tolerated fraction of unconverged samples), got {s.stop_quantile}"),
            ("damping", 0.0 < s.damping <= 1.0, f"must lie in (0, 1], got {s.damping}"),
            ("patience", s.patience >= 0, f"must be >= 0 (0 disables decay), got {s.patience}"),
            ("decay", 0.0 < s.decay < 1.0, f"must lie in (0, 1), got {s.decay}"),
            ("eta_min", s.eta_min < s.damping,
             f"must be below damping ({s.damping}), got {s.eta_min}: the solver would stop at once"),
            ("decisions", s.decisions in ("token", "sample"),
             f"must be token (damping, patience and freezing per token: causal) or sample (per sample, "
             f"the seeds' Algorithm 1: for non-causal maps), got {s.decisions!r}"),
            ("anderson", s.anderson == 0 or s.anderson >= 2,
             f"is the Anderson window: 0 (off) or >= 2, got {s.anderson}"),
            ("check_every", s.check_every >= 1, f"must be >= 1 (read the stop decision every N iterations; "
             f"1 = every iteration), got {s.check_every}"),
            ("bookkeeping", s.bookkeeping in ("auto", "fused", "torch"),
             f"must be auto, fused or torch, got {s.bookkeeping!r}"),
            ("bookkeeping", not (s.bookkeeping == "fused" and s.anderson), f"fused has no Anderson mixing "
             f"(anderson = {s.anderson}): use auto or torch, or anderson 0"),
            ("min_iter", s.min_iter >= 0, f"must be >= 0, got {s.min_iter}"),
            ("backward_min_iter", s.backward_min_iter >= 0, f"must be >= 0, got {s.backward_min_iter}"),
            ("anderson_variant", s.anderson_variant in ("fpscale", "attractor"),
             f"must be fpscale or attractor, got {s.anderson_variant!r}"),
            ("anderson_variant", s.anderson_variant == "fpscale" or s.anderson >= 2,
             f"attractor is an Anderson variant: set anderson to its window (>= 2, "
             f"Attractor uses 5), got anderson = {s.anderson}"),
            ("decisions", s.decisions == "sample" or (s.norm != "sample_l2" and s.anderson_variant == "fpscale"),
             "norm sample_l2 and anderson_variant attractor decide per sample (Attractor's solve has one "
             "residual, one beta and one Anderson system per sample): set decisions: sample"),
            ("bookkeeping", not (s.bookkeeping == "fused" and s.norm == "sample_l2"),
             "fused computes per-token residuals; norm sample_l2 (one residual per sample) runs on the "
             "PyTorch bookkeeping: use auto or torch"),
            ("chunk", s.chunk >= 0, f"must be >= 0 (0 = off; K = iterations per chunk), got {s.chunk}"),
            ("chunk_schedule", s.chunk_schedule in ("fixed", "expected"),
             f"must be fixed (a read after every chunk) or expected (the first read after the layer's previous "
             f"solve's iterations), got {s.chunk_schedule!r}"),
            ("cuda_graph", not s.cuda_graph or s.chunk > 0, f"captures the compiled chunk: it needs "
             f"{key_of('chunk', prefix or 'solver')} > 0 (K iterations per graph), got chunk = 0"),
            ("cuda_graph", not (s.cuda_graph and s.backward == "unroll"),
             "needs a traced chunk; backward unroll's training solve runs under autograd (not traced, not "
             "captured): use backward implicit, phantom or jfb, or cuda_graph false"),
            ("adjoint_step", s.adjoint_step in ("grad", "vjp"),
             f"must be grad (autograd.grad of the recorded f) or vjp (torch.func.vjp: a chunked adjoint "
             f"compiles), got {s.adjoint_step!r}"),
            ("eval_output", s.eval_output in ("step", "iterate"),
             f"must be step (evaluation outputs what training outputs at the same iterate) or iterate "
             f"(the last iterate z*), got {s.eval_output!r}"),
            ("phantom_steps", s.phantom_steps >= 1, f"must be >= 1, got {s.phantom_steps}"),
            ("backward_max_iter", s.backward_max_iter >= 1, f"must be >= 1, got {s.backward_max_iter}"),
        ]
        for name, holds, message in rules:
            check(holds, key_of(name, prefix), message)

    def with_overrides(self, overrides: dict, key: str) -> SolverConfig:
        """This config with one layer's ``solver`` overrides (nested or flat keys) applied (validated;
        errors name ``key``)."""
        from fpscale.typed import from_dict, merge, nest, to_dict
        return from_dict(SolverConfig, merge(to_dict(self), nest(overrides, PART_OF, key, warn=False)), key)

    @property
    def output_steps(self) -> int:
        """How many applications of f follow the solve in the grad-mode forward (jfb 1, phantom
        ``phantom_steps``; implicit and unroll 0: their value is z*)."""
        return {"jfb": 1, "phantom": self.phantom_steps}.get(self.backward, 0)

    @property
    def eval_iterations(self) -> int:
        """The cap of a solve in evaluation."""
        return self.eval_max_iter or self.max_iter


def _view(part: str, name: str) -> property:
    def read(self: SolverConfig) -> Any:           # a Python function: dynamo inlines it in a compiled chunk
        return getattr(getattr(self, part), name)
    return property(read, doc=f"``{part}.{name}`` (read-only; write ``cfg.{part}.{name}``)")


for _name, _part in PART_OF.items():       # cfg.tol reads cfg.forward.tol: read-only, one per field of a part
    setattr(SolverConfig, _name, _view(_part, _name))
