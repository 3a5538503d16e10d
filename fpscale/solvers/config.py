"""`SolverConfig`: every knob of the fixed-point solver and its backward pass."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fpscale.errors import check

BackwardMode = Literal["implicit", "neumann1", "phantom", "jfb", "unroll"]
IMPLICIT_MODES = ("implicit", "neumann1")       # the modes with an adjoint at z* (one f under grad)


@dataclass
class SolverConfig:
    """How a fixed point ``z = f(z)`` is found and differentiated.

    Forward (Algorithm 1 of FPRM, seed 004, plus the quantile stop of its App. D):
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
      stop_residual      the residual the convergence test reads: ``current`` (this iteration's, default)
                         or ``best`` (each sample's lowest so far: the FP-RNN authors' solver,
                         fpscale.solvers.stop_rule)
      eta_min            stop when every unconverged sample's eta fell below this
      freeze_converged   per-token selective update (FPSA): a converged token is frozen (always so
                         with ``decisions: token``; this key matters with ``sample``)
      anderson           Anderson acceleration window (0 = off, else >= 2)
      anderson_lambda    Tikhonov regularisation of Anderson's least squares
      anderson_variant   fpscale (default: lambda relative to the Gram's mean diagonal, the mixing
                         solved in float64, the mixed iterate returned) or attractor: jacobfa/Attractor's
                         (attractor/models/attractor/solvers.py:38-122): lambda absolute, the mixing
                         solved in float32, two plain steps before any mixing or stop test, the last
                         f(z) returned (fpscale.solvers.anderson)
      agree              rank (default) | dp: in training, each data-parallel rank stops its solves on
                         its own micro-batch (every optimizer step waits for the slowest rank), or
                         the stop decision (quantile, stall, non-finite) is taken over the DP group's
                         samples as one process would over all of them: equal work on every rank, one
                         3-int all-reduce over DP per iteration (forward and adjoint). Evaluation
                         and decoding always stop per rank
      check_every        read the stop decision on the host every N iterations (and at the cap);
                         the iterations between are valid further iterates and count. 1 (default):
                         every iteration. With no stop rule that can fire (tol 0, no eta_min stop
                         within the cap) the solve reads once, at its end, whatever N
    Backward (docs/solver.md, "Backward modes"):
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
    Speed:
      bookkeeping        auto | fused | torch: the iteration's residual, flags, damping, freezing and
                         damped step as 4 Triton kernels (fpscale.solvers.fused) or as about 40
                         PyTorch ops. auto (default): fused on CUDA where Triton imports. Solves with
                         autograd through the loop (unroll's training solve) or Anderson stay torch
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
      compile            torch.compile the layer's iteration step (one application of f, with
                         dynamic=False); the iteration loop stays in Python, so a different
                         iteration count never recompiles. Off until measured on the target device
    """

    max_iter: int = 30
    eval_max_iter: int = 0
    tol: float = 1e-2
    norm: Literal["inf", "l2", "sample_l2"] = "inf"
    min_iter: int = 0
    stop_quantile: float = 0.25
    damping: float = 1.0
    patience: int = 5
    decay: float = 0.7
    eta_min: float = 0.05
    stop_residual: Literal["current", "best"] = "current"
    decisions: Literal["token", "sample"] = "token"
    freeze_converged: bool = False
    anderson: int = 0
    anderson_lambda: float = 1e-4
    anderson_variant: Literal["fpscale", "attractor"] = "fpscale"
    eps: float = 1e-6
    check_every: int = 1
    agree: Literal["rank", "dp"] = "rank"
    backward: BackwardMode = "implicit"
    phantom_steps: int = 4
    eval_output: Literal["step", "iterate"] = "step"
    backward_max_iter: int = 40
    backward_tol: float = 1e-4
    backward_min_iter: int = 0
    backward_freeze: bool = False
    adjoint_step: Literal["grad", "vjp"] = "grad"
    mask_unconverged: bool = True
    bookkeeping: Literal["auto", "fused", "torch"] = "auto"
    compile: bool = False
    chunk: int = 0
    chunk_schedule: Literal["fixed", "expected"] = "fixed"
    cuda_graph: bool = False

    def validate(self, prefix: str = "") -> None:
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        check(self.max_iter >= 1, key("max_iter"), f"must be >= 1, got {self.max_iter}")
        check(self.eval_max_iter >= 0, key("eval_max_iter"),
              f"must be >= 0 (0 = max_iter), got {self.eval_max_iter}")
        for name in ("tol", "backward_tol", "eps", "anderson_lambda", "eta_min"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, key(name), f"must be a finite number >= 0, got {value}")
        check(0.0 <= self.stop_quantile < 1.0, key("stop_quantile"),
              f"must lie in [0, 1) (the tolerated fraction of unconverged samples), got {self.stop_quantile}")
        check(0.0 < self.damping <= 1.0, key("damping"), f"must lie in (0, 1], got {self.damping}")
        check(self.patience >= 0, key("patience"), f"must be >= 0 (0 disables decay), got {self.patience}")
        check(0.0 < self.decay < 1.0, key("decay"), f"must lie in (0, 1), got {self.decay}")
        check(self.eta_min < self.damping, key("eta_min"),
              f"must be below damping ({self.damping}), got {self.eta_min}: the solver would stop at once")
        check(self.decisions in ("token", "sample"), key("decisions"),
              f"must be token (damping, patience and freezing per token: causal) or sample (per sample, "
              f"the seeds' Algorithm 1: for non-causal maps), got {self.decisions!r}")
        check(self.anderson == 0 or self.anderson >= 2, key("anderson"),
              f"is the Anderson window: 0 (off) or >= 2, got {self.anderson}")
        check(self.check_every >= 1, key("check_every"),
              f"must be >= 1 (read the stop decision every N iterations; 1 = every iteration), "
              f"got {self.check_every}")
        check(self.bookkeeping in ("auto", "fused", "torch"), key("bookkeeping"),
              f"must be auto, fused or torch, got {self.bookkeeping!r}")
        check(not (self.bookkeeping == "fused" and self.anderson), key("bookkeeping"),
              f"fused has no Anderson mixing (anderson = {self.anderson}): use auto or torch, or anderson 0")
        for name in ("min_iter", "backward_min_iter"):
            check(getattr(self, name) >= 0, key(name), f"must be >= 0, got {getattr(self, name)}")
        check(self.anderson_variant in ("fpscale", "attractor"), key("anderson_variant"),
              f"must be fpscale or attractor, got {self.anderson_variant!r}")
        check(self.anderson_variant == "fpscale" or self.anderson >= 2, key("anderson_variant"),
              f"attractor is an Anderson variant: set anderson to its window (>= 2, Attractor uses 5), "
              f"got anderson = {self.anderson}")
        check(self.decisions == "sample" or (self.norm != "sample_l2" and self.anderson_variant == "fpscale"),
              key("decisions"), "norm sample_l2 and anderson_variant attractor decide per sample (Attractor's "
              "solve has one residual, one beta and one Anderson system per sample): set decisions: sample")
        check(not (self.bookkeeping == "fused" and self.norm == "sample_l2"), key("bookkeeping"),
              "fused computes per-token residuals; norm sample_l2 (one residual per sample) runs on the "
              "PyTorch bookkeeping: use auto or torch")
        check(self.chunk >= 0, key("chunk"), f"must be >= 0 (0 = off; K = iterations per chunk), got {self.chunk}")
        check(self.chunk_schedule in ("fixed", "expected"), key("chunk_schedule"),
              f"must be fixed (a read after every chunk) or expected (the first read after the layer's previous "
              f"solve's iterations), got {self.chunk_schedule!r}")
        check(not self.cuda_graph or self.chunk > 0, key("cuda_graph"),
              "captures the compiled chunk: it needs solver.chunk > 0 (K iterations per graph), got chunk = 0")
        check(not (self.cuda_graph and self.backward == "unroll"), key("cuda_graph"),
              "needs a traced chunk; backward unroll's training solve runs under autograd (not traced, not "
              "captured): use backward implicit, phantom or jfb, or cuda_graph false")
        check(self.adjoint_step in ("grad", "vjp"), key("adjoint_step"),
              f"must be grad (autograd.grad of the recorded f) or vjp (torch.func.vjp: a chunked adjoint "
              f"compiles), got {self.adjoint_step!r}")
        check(self.eval_output in ("step", "iterate"), key("eval_output"),
              f"must be step (evaluation outputs what training outputs at the same iterate) or iterate "
              f"(the last iterate z*), got {self.eval_output!r}")
        check(self.phantom_steps >= 1, key("phantom_steps"), f"must be >= 1, got {self.phantom_steps}")
        check(self.backward_max_iter >= 1, key("backward_max_iter"),
              f"must be >= 1, got {self.backward_max_iter}")

    def with_overrides(self, overrides: dict, key: str) -> "SolverConfig":
        """This config with one layer's ``solver`` overrides applied (validated; errors name ``key``)."""
        from fpscale.typed import from_dict, to_dict
        return from_dict(SolverConfig, {**to_dict(self), **overrides}, key)

    @property
    def output_steps(self) -> int:
        """How many applications of f follow the solve in the grad-mode forward (jfb 1, phantom
        ``phantom_steps``; implicit and unroll 0: their value is z*)."""
        return {"jfb": 1, "phantom": self.phantom_steps}.get(self.backward, 0)

    @property
    def eval_iterations(self) -> int:
        """The cap of a solve in evaluation."""
        return self.eval_max_iter or self.max_iter
