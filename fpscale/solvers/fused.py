"""The solver's bookkeeping in four Triton kernels per iteration (``solver.bookkeeping``).

The PyTorch loop (fpscale.solvers.iterate) spends about 40 small kernels per iteration beside f:
the residual (sub, abs, two amax, a division), the masks, the per-sample flags, Algorithm 1's
patience and damping, the damped step and the freeze ``where``, about 9 of them full-size passes.
Here one iteration is f, then

  norms    per token: ||f(z) - z|| and ||f(z)|| (inf: amax of |.|, l2: sum of squares) in one
           read of z and f(z)                                       grid: blocks of tokens
  [state_reduce: the partial norms summed / maxed over the shards where z is split (TP FP-Mamba)]
  flags    per sample: the relative residual of each token (a frozen token keeps its last one,
           padding counts 0), its max over the tokens (tested against tol, or its lowest so far
           with ``solver.stop_residual: best``), and the flags
           [non-finite, unconverged, no new best] per sample as int64 [3, B]   grid: B
  [consensus: the flags MAX-reduced over the group, one small all-reduce, as in the PyTorch loop]
  decide   per sample: best residual, patience, the next damping (Algorithm 1), and the decision
           [unconverged count, quantile met, stalled, non-finite, first non-finite iteration]
                                                                    grid: 1
           (``solver.agree: dp``: the decision's counts are summed over the DP group first, then a
           fifth kernel, ``_agreed``, commits the decision)
           ``decisions: token`` (the default): ``flags`` writes per-token flags, then ``_tokens``
           (grid B: each token's best, patience and next damping, the sample's [non-finite,
           unconverged, movable]) and ``_decide_samples`` (grid 1: the decision), 5 kernels
  update   z' = eta f(z) + (1 - eta) z (eta per sample or per token; per token a token retires
           once every token up to it converged or stalled: ``_tokens`` decides), holding frozen tokens
           and, once a residual went non-finite, every token; the frozen flags and the last finite residual per token
                                                                    grid: blocks of tokens
and, at the iterations the read schedule names, one host read of the decision (5 int64).
f(z) may be in any dtype (cast in the kernels: no copy); the state, residuals and damping stay
in the solver's state dtype (float32, float64 for float64 maps), as in the PyTorch loop.

Semantics are those of the PyTorch loop, iteration for iteration: the same iterates, iteration
counts, damping and stop reasons (tests/solvers/test_fused.py holds them equal under Triton's
interpreter, float64 and float32, on synthetic maps with every stop rule, freezing, padding,
non-finite residuals and the read schedules, and on every tiny config). A non-finite residual
is handled as the deferred PyTorch loop does: it is remembered on the device, nothing moves from
then on, and the read reports the iteration that went non-finite, so the eager schedule (a read
every iteration) stops exactly where the PyTorch loop stops. The l2 norm's sums are reduced in
another order than ``torch.linalg.vector_norm``: residuals agree to rounding there, bit-for-bit
with the inf norm. The update is launched without FMA contraction (``enable_fp_fusion=False``) so
that on a GPU it rounds as PyTorch's separate mul and add do.

Where it runs (``fused_wanted``): ``auto`` (default) on CUDA tensors when
Triton imports, for every solve without autograd through the loop (the forward solve of the
implicit, phantom and jfb backward modes, every adjoint solve, evaluation); the unroll backward's
training solve keeps the PyTorch loop, and so do the features the kernels lack (``unfused_features``:
Anderson, ``sample_l2``, entry groups, a carried state), with a warning, once per set of features, in
``auto`` on CUDA and in ``fused`` (which validate() refuses with Anderson or sample_l2). ``fused``
requires it (on CPU only under ``TRITON_INTERPRET=1``, set before this module is first imported: Triton
decides per kernel at its definition); ``torch`` never. Block sizes are untuned defaults (run on H200s: docs/gpu.md).

    python bench/solver_overhead.py --bookkeeping fused      # kernels per iteration, on CPU via the interpreter

Over 400 lines: the per-sample and per-token (``decisions``) variants are the same five steps over one
host loop and share their jit helpers (``_columns``, ``_commit``); split, each half would import the
other's kernels.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable

import torch

from fpscale.profiling import _ACTIVE as COUNTING
from fpscale.profiling import opaque_kernel, tensor_bytes
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.loop_state import NEVER, IterateResult, check_step_output, entry_changed, state_dtype

FUSED_ERROR: Exception | None = None
try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as exc:          # not installed: the PyTorch loop, said once on CUDA
    triton = tl = None  # type: ignore[assignment]
    FUSED_ERROR = exc if exc.name not in ("triton", None) else None
except Exception as exc:                    # installed but broken: an error where it is wanted
    triton = tl = None  # type: ignore[assignment]
    FUSED_ERROR = exc
AVAILABLE = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if AVAILABLE:
    @triton.jit
    def _columns(z_ptr, f_ptr, base, rmask, c0, D, BLOCK_D: tl.constexpr):
        """A [rows, BLOCK_D] block of z and of f(z) (cast to z's dtype) from column c0, its mask and offsets."""
        cols = c0 + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (cols[None, :] < D)
        off = base[:, None] + cols[None, :]
        z = tl.load(z_ptr + off, mask=m, other=0.0)
        f = tl.load(f_ptr + off, mask=m, other=0.0).to(z.dtype)
        return z, f, m, off

    @triton.jit
    def _norms(z_ptr, f_ptr, part_ptr, N, D, L2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < N
        base = rows.to(tl.int64) * D
        acc_d = tl.zeros([BLOCK_R], dtype=z_ptr.dtype.element_ty)
        acc_r = tl.zeros([BLOCK_R], dtype=z_ptr.dtype.element_ty)
        nan = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, D, BLOCK_D):
            z, f, m, off = _columns(z_ptr, f_ptr, base, rmask, c0, D, BLOCK_D)
            d = f - z
            if L2:
                acc_d += tl.sum(d * d, axis=1)
                acc_r += tl.sum(f * f, axis=1)
            else:        # amax propagates NaN, as torch.amax does (tl.max need not)
                ad, af = tl.abs(d), tl.abs(f)
                nan = tl.maximum(nan, tl.max(((ad != ad) | (af != af)).to(tl.int32), axis=1))
                acc_d = tl.maximum(acc_d, tl.max(ad, axis=1))
                acc_r = tl.maximum(acc_r, tl.max(af, axis=1))
        if not L2:
            acc_d = tl.where(nan > 0, float("nan"), acc_d)
        tl.store(part_ptr + rows, acc_d, mask=rmask)
        tl.store(part_ptr + N + rows, acc_r, mask=rmask)

    @triton.jit
    def _flags(part_ptr, frozen_ptr, tres_ptr, real_ptr, best_ptr, consts_ptr, res_ptr, sres_ptr, flags_ptr,
               B, T, L2: tl.constexpr, HAS_REAL: tl.constexpr, BEST: tl.constexpr, TOKEN: tl.constexpr,
               BLOCK_T: tl.constexpr):
        """Per sample b: the tokens' residuals and their max. Flags, ``decisions: sample``:
        [nonfinite (B), unconverged (B), no new best (B)]; ``token``: [nonfinite (B),
        unconverged (B * T), no new best (B * T)], each token tested against its own best."""
        b = tl.program_id(0)
        N = B * T
        tol = tl.load(consts_ptr)
        eps = tl.load(consts_ptr + 1)
        acc = tl.full([BLOCK_T], float("-inf"), dtype=tol.dtype)
        nan = tl.zeros([BLOCK_T], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            m = t < T
            idx = b.to(tl.int64) * T + t
            p0 = tl.load(part_ptr + idx, mask=m, other=0.0)
            p1 = tl.load(part_ptr + N + idx, mask=m, other=1.0)
            if L2:
                r = tl.sqrt(p0) / (tl.sqrt(p1) + eps)
            else:
                r = p0 / (p1 + eps)
            frozen = tl.load(frozen_ptr + idx, mask=m, other=0) != 0
            r = tl.where(frozen, tl.load(tres_ptr + idx, mask=m, other=0.0), r)
            if HAS_REAL:
                r = tl.where(tl.load(real_ptr + idx, mask=m, other=1) != 0, r, 0.0)
            tl.store(res_ptr + idx, r, mask=m)
            if TOKEN:
                best_t = tl.load(best_ptr + idx, mask=m, other=0.0)
                bad_t = (r != r) | (tl.abs(r) == float("inf"))
                tested_t = r
                if BEST:
                    tested_t = tl.where(bad_t, r, tl.minimum(r, best_t))
                tl.store(flags_ptr + B + idx, (~(tested_t < tol)).to(tl.int64), mask=m)
                tl.store(flags_ptr + B + N + idx, (~(r < best_t)).to(tl.int64), mask=m)
            r = tl.where(m, r, float("-inf"))
            nan = tl.maximum(nan, (r != r).to(tl.int32))
            acc = tl.maximum(acc, r)
        s = tl.max(acc, axis=0)
        s = tl.where(tl.max(nan, axis=0) > 0, float("nan"), s)
        tl.store(sres_ptr + b, s)
        nonfinite = (s != s) | (tl.abs(s) == float("inf"))
        tl.store(flags_ptr + b, nonfinite.to(tl.int64))
        if not TOKEN:
            best = tl.load(best_ptr + b)
            tested = s
            if BEST:     # solver.stop_residual best: the lowest residual so far (fpscale.solvers.stop_rule)
                tested = tl.where(nonfinite, s, tl.minimum(s, best))
            tl.store(flags_ptr + B + b, (~(tested < tol)).to(tl.int64))
            tl.store(flags_ptr + 2 * B + b, (~(s < best)).to(tl.int64))

    @triton.jit
    def _tokens(flags_ptr, res_ptr, best_ptr, patience_ptr, eta_ptr, eta_out_ptr, consts_ptr, sample_ptr,
                retire_ptr, prefix_ptr, k, B, T, patience, PATIENCE: tl.constexpr, HAS_PREFIX: tl.constexpr,
                BLOCK_T: tl.constexpr):
        """``decisions: token``, per sample b (after the consensus): each token's best residual,
        patience and next damping (Algorithm 1 per token), whether it retires (every token up to it
        done: converged, or its next eta below eta_min; the prefix rule), and the sample's
        [non-finite, has an unconverged token, has a movable one (unconverged, next eta >= eta_min)]."""
        b = tl.program_id(0)
        N = B * T
        unconv = tl.zeros([BLOCK_T], dtype=tl.int64)
        movable = tl.zeros([BLOCK_T], dtype=tl.int64)
        not_done_before = 0
        if HAS_PREFIX:      # the tokens before this chunk (cached decoding): done from iteration prefix[b]
            not_done_before = (tl.load(prefix_ptr + b) > k).to(tl.int32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            m = t < T
            idx = b.to(tl.int64) * T + t
            u = tl.load(flags_ptr + B + idx, mask=m, other=0)
            no_progress = tl.load(flags_ptr + B + N + idx, mask=m, other=0) != 0
            best = tl.load(best_ptr + idx, mask=m, other=0.0)
            tl.store(best_ptr + idx, tl.where(no_progress, best, tl.load(res_ptr + idx, mask=m, other=0.0)), mask=m)
            eta = tl.load(eta_ptr + idx, mask=m, other=0.0)
            next_eta = eta
            if PATIENCE:
                left = tl.load(patience_ptr + idx, mask=m, other=0)
                left = tl.where(no_progress, left - 1, patience)
                decay_now = left <= 0
                next_eta = tl.where(decay_now, eta * tl.load(consts_ptr + 2), eta)
                tl.store(patience_ptr + idx, tl.where(decay_now, patience, left), mask=m)
            tl.store(eta_out_ptr + idx, next_eta, mask=m)
            unconv = tl.maximum(unconv, u)
            not_done = ((u != 0) & ~(next_eta < tl.load(consts_ptr + 3)) & m).to(tl.int32)
            movable = tl.maximum(movable, not_done.to(tl.int64))
            before = tl.cumsum(not_done, axis=0) + not_done_before        # not-done tokens up to t
            tl.store(retire_ptr + idx, (before == 0).to(tl.int8), mask=m)
            not_done_before += tl.sum(not_done, axis=0)
        tl.store(sample_ptr + b, tl.load(flags_ptr + b))
        tl.store(sample_ptr + B + b, tl.max(unconv, axis=0))
        tl.store(sample_ptr + 2 * B + b, tl.max(movable, axis=0))

    @triton.jit
    def _decide_samples(sample_ptr, alive_ptr, first_bad_ptr, decision_ptr, counts_ptr, B, k, limit,
                        AGREE: tl.constexpr, BLOCK_B: tl.constexpr):
        """``decisions: token``: the decision from ``_tokens``' per-sample flags (the damping per token
        is committed by ``_update``, which holds it once a residual went non-finite)."""
        i = tl.arange(0, BLOCK_B)
        m = i < B
        n_bad = tl.max(tl.load(sample_ptr + i, mask=m, other=0), axis=0)
        n_unconverged = tl.sum(tl.load(sample_ptr + B + i, mask=m, other=0), axis=0)
        movable = tl.sum(tl.load(sample_ptr + 2 * B + i, mask=m, other=0), axis=0)
        if AGREE:
            tl.store(counts_ptr, n_unconverged)
            tl.store(counts_ptr + 1, movable)
            tl.store(counts_ptr + 2, n_bad.to(tl.int64))
        else:
            zero = tl.zeros([BLOCK_B], dtype=tl.float32)
            _commit(n_unconverged, movable, n_bad, zero, zero, i, m, alive_ptr, first_bad_ptr, alive_ptr,
                    decision_ptr, k, limit, ETA=False)

    @triton.jit
    def _commit(n_unconverged, movable, n_bad, eta, next_eta, i, m, alive_ptr, first_bad_ptr, eta_out_ptr,
                decision_ptr, k, limit, ETA: tl.constexpr):
        """The iteration's decision from its counts (this rank's, or the DP group's): a non-finite
        residual holds everything from now on, else eta moves on (per sample here, ``ETA``; per
        token in ``_update``); the 5 numbers the host reads."""
        alive = tl.load(alive_ptr)
        first_bad = tl.load(first_bad_ptr)
        bad_now = n_bad > 0
        first_bad = tl.where((alive != 0) & bad_now, k, first_bad)
        alive = tl.where(bad_now, 0, alive)
        if ETA:
            tl.store(eta_out_ptr + i, tl.where(alive != 0, next_eta, eta), mask=m)
        tl.store(decision_ptr, n_unconverged)
        tl.store(decision_ptr + 1, (n_unconverged <= limit).to(tl.int64))
        tl.store(decision_ptr + 2, (movable == 0).to(tl.int64))
        tl.store(decision_ptr + 3, (alive == 0).to(tl.int64))
        tl.store(decision_ptr + 4, first_bad)
        tl.store(alive_ptr, alive)
        tl.store(first_bad_ptr, first_bad)

    @triton.jit
    def _decide(flags_ptr, sres_ptr, best_ptr, patience_ptr, eta_ptr, eta_out_ptr, alive_ptr, first_bad_ptr,
                consts_ptr, decision_ptr, counts_ptr, B, k, limit, patience,
                PATIENCE: tl.constexpr, AGREE: tl.constexpr, BLOCK_B: tl.constexpr):
        i = tl.arange(0, BLOCK_B)
        m = i < B
        nonfinite = tl.load(flags_ptr + i, mask=m, other=0)
        unconverged = tl.load(flags_ptr + B + i, mask=m, other=0)
        no_progress = tl.load(flags_ptr + 2 * B + i, mask=m, other=0) != 0
        best = tl.load(best_ptr + i, mask=m, other=0.0)
        tl.store(best_ptr + i, tl.where(no_progress, best, tl.load(sres_ptr + i, mask=m, other=0.0)), mask=m)
        eta = tl.load(eta_ptr + i, mask=m, other=0.0)
        next_eta = eta
        if PATIENCE:     # Algorithm 1, per sample: progress resets the patience, stagnation decays eta
            left = tl.load(patience_ptr + i, mask=m, other=0)
            left = tl.where(no_progress, left - 1, patience)
            decay_now = left <= 0
            next_eta = tl.where(decay_now, eta * tl.load(consts_ptr + 2), eta)
            tl.store(patience_ptr + i, tl.where(decay_now, patience, left), mask=m)
        n_unconverged = tl.sum(unconverged, axis=0)
        movable = tl.sum(((unconverged != 0) & ~(next_eta < tl.load(consts_ptr + 3))).to(tl.int64), axis=0)
        n_bad = tl.max(nonfinite, axis=0)
        if AGREE:        # the counts go to the DP group first; _agreed commits with its sums
            tl.store(counts_ptr, n_unconverged)
            tl.store(counts_ptr + 1, movable)
            tl.store(counts_ptr + 2, n_bad.to(tl.int64))
            tl.store(eta_out_ptr + i, next_eta, mask=m)
        else:
            _commit(n_unconverged, movable, n_bad, eta, next_eta, i, m, alive_ptr, first_bad_ptr, eta_out_ptr,
                    decision_ptr, k, limit, ETA=True)

    @triton.jit
    def _agreed(counts_ptr, eta_ptr, eta_out_ptr, alive_ptr, first_bad_ptr, decision_ptr, B, k, limit,
                ETA: tl.constexpr, BLOCK_B: tl.constexpr):
        """``_decide``'s commit with the counts summed over the DP group (``solver.agree: dp``)."""
        i = tl.arange(0, BLOCK_B)
        m = i < B
        eta = tl.load(eta_ptr + i, mask=m, other=0.0)
        next_eta = tl.load(eta_out_ptr + i, mask=m, other=0.0)
        _commit(tl.load(counts_ptr), tl.load(counts_ptr + 1), tl.load(counts_ptr + 2), eta, next_eta, i, m,
                alive_ptr, first_bad_ptr, eta_out_ptr, decision_ptr, k, limit, ETA=ETA)

    @triton.jit
    def _update(z_ptr, f_ptr, out_ptr, eta_ptr, frozen_ptr, tres_ptr, res_ptr, alive_ptr, consts_ptr, N, D, T,
                eta_out_ptr, retire_ptr, retired_at_ptr, k, FREEZE: tl.constexpr, TOKEN: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """The damped step and freezing. ``TOKEN`` (``decisions: token``): eta per token, a token
        retires where ``_tokens`` said (every token up to it converged or stalled), and the
        next eta is held once a residual went non-finite."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < N
        base = rows.to(tl.int64) * D
        alive = tl.load(alive_ptr) != 0
        if TOKEN:
            eta1 = tl.load(eta_ptr + rows, mask=rmask, other=0.0)
            next_eta = tl.load(eta_out_ptr + rows, mask=rmask, other=0.0)
            tl.store(eta_out_ptr + rows, tl.where(alive, next_eta, eta1), mask=rmask)
            eta = eta1[:, None]
        else:
            eta = tl.load(eta_ptr + rows // T, mask=rmask, other=0.0)[:, None]
        hold = (rows * 0 + (1 - alive.to(tl.int32))) != 0          # every token, once non-finite
        frozen = tl.load(frozen_ptr + rows, mask=rmask, other=0) != 0
        if FREEZE or TOKEN:
            hold = hold | frozen
        for c0 in range(0, D, BLOCK_D):
            z, f, m, off = _columns(z_ptr, f_ptr, base, rmask, c0, D, BLOCK_D)
            step = eta * f + (1 - eta) * z
            tl.store(out_ptr + off, tl.where(hold[:, None], z, step), mask=m)
        res = tl.load(res_ptr + rows, mask=rmask, other=0.0)
        if TOKEN:       # the prefix rule, decided by _tokens
            newly = frozen | (tl.load(retire_ptr + rows, mask=rmask, other=0) != 0)
            tl.store(frozen_ptr + rows, tl.where(alive, newly, frozen).to(tl.int8), mask=rmask)
            last = rmask & ((rows % T) == (T - 1))
            old = tl.load(retired_at_ptr + rows // T, mask=last, other=0)
            became = (newly != frozen) & alive                                 # the last token retires now
            tl.store(retired_at_ptr + rows // T, tl.where(became, old * 0 + k, old), mask=last)
        elif FREEZE:
            newly = frozen | (res < tl.load(consts_ptr))
            tl.store(frozen_ptr + rows, tl.where(alive, newly, frozen).to(tl.int8), mask=rmask)
        tres = tl.load(tres_ptr + rows, mask=rmask, other=0.0)
        tl.store(tres_ptr + rows, tl.where(alive, res, tres), mask=rmask)


def fused_wanted(cfg: SolverConfig, z: torch.Tensor, *, group: int = 1, carried: bool = False) -> bool:
    """Whether this solve's bookkeeping runs as fpscale.solvers.fused's kernels (``solver.bookkeeping``):
    never with autograd through the loop (the unroll backward's training solve) or for an empty state;
    never for a feature the kernels lack (``unfused_features``: the PyTorch step runs it, and says so
    once, loudly, where the kernels would otherwise have run); else ``auto``: on CUDA where Triton
    imports, ``fused``: always (an error where the kernels cannot run), ``torch``: never."""
    if cfg.bookkeeping == "torch" or torch.is_grad_enabled() or z.numel() == 0:
        return False
    if cfg.bookkeeping == "auto" and not z.is_cuda:
        return False
    missing = unfused_features(cfg, group, carried)
    if missing:       # validate() refuses bookkeeping: fused with anderson / sample_l2, naming the key
        _warn_fallback_once(cfg.bookkeeping, missing)
        return False
    if FUSED_ERROR is not None:
        error = FUSED_ERROR
        raise RuntimeError(f"solver.bookkeeping = {cfg.bookkeeping}: triton is installed but does not import "
                           f"({error!r}); reinstall it, or set solver.bookkeeping=torch") from error
    if cfg.bookkeeping == "fused" and not runnable(z):
        where = ("triton is not installed (pip install triton)" if not AVAILABLE else
                 f"its kernels run on CUDA tensors, or on CPU under TRITON_INTERPRET=1 set before "
                 f"fpscale.solvers.fused is imported; this solve's state is on {z.device}")
        raise RuntimeError(f"solver.bookkeeping = fused: {where}. Use auto (fused on CUDA) or torch")
    if not AVAILABLE:
        _warn_unfused_once()
        return False
    return True


def unfused_features(cfg: SolverConfig, group: int = 1, carried: bool = False) -> tuple[str, ...]:
    """The features of this solve the kernels do not run (docs/solver.md's mode x feature table)."""
    return tuple(name for name, on in (
        (f"solver.anderson = {cfg.anderson}", cfg.anderson > 0),
        ("solver.norm = sample_l2", cfg.norm == "sample_l2"),
        (f"entry groups of {group} (fpsa halting: head)", group > 1),
        ("a carried state (deep supervision's windows)", carried)) if on)


@functools.cache
def _warn_fallback_once(mode: str, missing: tuple[str, ...]) -> None:
    warnings.warn(f"solver.bookkeeping = {mode}: the fused kernels have no {' / '.join(missing)}; this solve's "
                  f"bookkeeping runs as the PyTorch step (about 40 kernels an iteration beside f, not 4-5: "
                  f"bench/solver_overhead.py). Set solver.bookkeeping=torch to silence this", stacklevel=4)


@functools.cache
def _warn_unfused_once() -> None:
    warnings.warn("solver.bookkeeping = auto on CUDA without triton: every solver iteration runs its "
                  "bookkeeping as about 40 PyTorch kernels beside f (4 fused Triton kernels with triton; "
                  "bench/solver_overhead.py). pip install triton (a CUDA torch wheel brings it)", stacklevel=3)


def runnable(z: torch.Tensor) -> bool:
    """Whether the kernels can run on ``z``'s device here: CUDA with Triton, or CPU under the interpreter."""
    return AVAILABLE and (z.is_cuda or (INTERPRET and z.device.type == "cpu"))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _launch(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``; under a counter (bench/solver_overhead.py) one op that moves
    its tensor arguments once each (what each of these kernels reads or writes)."""
    moved = tensor_bytes(args) if COUNTING else 0
    with opaque_kernel(f"triton.solver.{kernel.__name__.lstrip('_')}", moved):
        kernel[grid](*args, **meta)


def iterate_fused(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig, *,
                  every: int | None, limit: int, consensus, state_reduce, max_iter: int,
                  real: torch.Tensor | None, agree=None, min_iter: int = 0, prefix: torch.Tensor | None = None,
                  count_entries: bool = False):
    """``fpscale.solvers.iterate.iterate`` without Anderson and without autograd through the loop,
    its bookkeeping in the four kernels above; ``every`` is its read schedule, ``limit`` the number
    of samples that may stay unconverged (``quantile_limit``)."""
    dtype = state_dtype(z0.dtype)
    z = z0.detach().to(dtype).contiguous()
    B, T = z.shape[:2]
    N = B * T
    D = z.numel() // N if N else 1
    dev = z.device

    def full(n, value, dt=dtype):
        return torch.full((n,), value, dtype=dt, device=dev)

    token = cfg.decisions == "token"
    U = N if token else B                         # units of Algorithm 1's state: tokens or samples
    consts = torch.tensor([cfg.tol, cfg.eps, cfg.decay, cfg.eta_min], dtype=dtype, device=dev)
    part, res, sres = torch.empty(2 * N, dtype=dtype, device=dev), torch.empty(N, dtype=dtype, device=dev), \
        torch.empty(B, dtype=dtype, device=dev)
    flags, decision = torch.empty(B + 2 * U, dtype=torch.long, device=dev), torch.zeros(5, dtype=torch.long, device=dev)
    counts, per_sample = torch.zeros(3, dtype=torch.long, device=dev), torch.zeros(3 * B, dtype=torch.long, device=dev)
    retire = torch.zeros(N if token else 1, dtype=torch.int8, device=dev)
    retired_at = torch.full((B,), NEVER, dtype=torch.long, device=dev)
    prefix = prefix.to(device=dev, dtype=torch.long).contiguous() if prefix is not None else retired_at
    best, patience_left = full(U, float("inf")), full(U, cfg.patience, torch.long)
    eta, eta_next = full(U, cfg.damping), torch.empty(U, dtype=dtype, device=dev)
    alive, first_bad = full(1, 1, torch.int32), full(1, max_iter, torch.long)
    frozen, token_res = full(N, 0, torch.int8), full(N, float("inf"))
    entry_iters = torch.zeros(N, dtype=torch.int32, device=dev) if count_entries else None
    real8 = real.to(torch.int8).contiguous() if real is not None else frozen
    block_d = min(_pow2(D), 256)
    block_r = max(1, min(_pow2(N), 4096 // block_d))
    grid_rows = (triton.cdiv(N, block_r),)
    l2 = cfg.norm == "l2"
    stopped_by, k = "max_iter", 0
    for k in range(1, max_iter + 1):
        fz = step(z)
        if k == 1:
            check_step_output(fz, z)
        if not fz.is_contiguous():
            fz = fz.contiguous()
        _launch(_norms, grid_rows, z, fz, part, N, D, L2=l2, BLOCK_R=block_r, BLOCK_D=block_d)
        parts = part if state_reduce is None else state_reduce(part.view(2, N), "sum" if l2 else "max").reshape(-1)
        _launch(_flags, (B,), parts, frozen, token_res, real8, best, consts, res, sres, flags, B, T,
                L2=l2, HAS_REAL=real is not None, BEST=cfg.stop_residual == "best", TOKEN=token,
                BLOCK_T=min(_pow2(T), 1024))
        agreed = flags if consensus is None else consensus(flags)
        if token:
            _launch(_tokens, (B,), agreed, res, best, patience_left, eta, eta_next, consts, per_sample, retire,
                    prefix, k, B, T, cfg.patience, PATIENCE=cfg.patience > 0, HAS_PREFIX=prefix is not retired_at,
                    BLOCK_T=min(_pow2(T), 1024))
            _launch(_decide_samples, (1,), per_sample, alive, first_bad, decision, counts, B, k, limit,
                    AGREE=agree is not None, BLOCK_B=_pow2(B))
        else:
            _launch(_decide, (1,), agreed, sres, best, patience_left, eta, eta_next, alive, first_bad, consts,
                    decision, counts, B, k, limit, cfg.patience, PATIENCE=cfg.patience > 0,
                    AGREE=agree is not None, BLOCK_B=_pow2(B))
        if agree is not None:
            _launch(_agreed, (1,), agree(counts), eta, eta_next, alive, first_bad, decision, B, k, limit,
                    ETA=not token, BLOCK_B=_pow2(B))
        z_next = torch.empty_like(z)
        _launch(_update, grid_rows, z, fz, z_next, eta, frozen, token_res, res, alive, consts, N, D, T,
                eta_next, retire, retired_at, k, FREEZE=cfg.freeze_converged, TOKEN=token, BLOCK_R=block_r,
                BLOCK_D=block_d, enable_fp_fusion=False)
        if entry_iters is not None:      # the steps in which each entry changed (SolveContext.count_entries)
            entry_iters += entry_changed(z_next, z).view(-1)
        z, eta, eta_next = z_next, eta_next, eta
        if k == max_iter or (every is not None and k % every == 0):
            n_unconverged, met, stalled, nonfinite, bad_at = decision.tolist()
            if nonfinite:
                stopped_by, k = "nonfinite", bad_at
                break
            if every is not None and k >= min_iter and (met or stalled):
                stopped_by = "converged" if n_unconverged == 0 else "quantile" if met else "eta_min"
                break
    token_res = token_res.view(B, T)
    return IterateResult(z=z, iterations=k, stopped_by=stopped_by, token_res=token_res,
                         token_converged=token_res < cfg.tol, eta=eta.view(B, T) if token else eta,
                         retired_at=retired_at, entry_iters=None if entry_iters is None else entry_iters.view(B, T))
