"""The fixed-point iteration shared by the forward solve and the adjoint solve.

One loop, at most one host synchronisation per iteration (the stop decision):
  state                 z is kept in float32 (float64 stays float64) whatever dtype f computes in
  residual per token    r_t = ||f(z)_t - z_t|| / (||f(z)_t|| + eps)     (inf or l2 norm)
  residual per sample   r_b = max_t r_t;   sample b is converged when r_b < tol (``stop_residual``
                        best: when its lowest r_b so far is; fpscale.solvers.stop_rule)
  quantile stop         stop once at most floor(p * B) samples are unconverged, i.e. at least
                        (1 - p) of the B samples this solve sees have converged (p = 0: all)
  decisions             where Algorithm 1's damping, patience and freezing live (``solver.decisions``):
    token (default)     per token, the causal rule: token t's eta_t, best r_t and patience follow
                        its own residual r_t, which a causal f computes from tokens <= t; token t
                        retires (is frozen) once every token s <= t is done, converged (r_s < tol)
                        or stalled (eta_s below eta_min): the prefix rule, so its value is what it
                        was then whenever the solve stops, and nothing it reads moves afterwards.
                        Anderson mixes per token. docs/solver.md, "Causality"
    sample              per sample (FPRM Algorithm 1 applied to each sample, as the FP-RNN authors'
                        solver does): every token of a sample shares eta_b, which the sample's
                        largest residual drives; freezing only with ``freeze_converged``
  damped step           z <- eta f(z) + (1 - eta) z   (or Anderson mixing, weight eta)
  patience              eta <- decay * eta after `patience` steps without a new best residual
  safeguards            cap; every unconverged unit's eta below eta_min; non-finite residual
                        (the last finite z is kept)
  freezing              a converged token is frozen: its value never changes again

Under tensor parallelism a ``consensus`` callable takes the MAX of this rank's :class:`StopFlags`
over the group once per iteration (packed into one tensor, so one all-reduce). Every decision
(stopping, each sample's eta) is a function of the agreed flags, so all ranks take the same
number of iterations with the same damping, even if their residuals differed in the last bit.
The decision then reaches the host as one :class:`StopDecision` (the iteration's one sync).

When the host reads it (``read_schedule``; docs/solver.md, "When the host reads the stop"):
  eager        every iteration (``check_every: 1``, the default, with a stop rule that can fire)
  check_every  every N-th iteration and at the cap: the iterations between run as the eager solve
               would have run them had it not stopped (each is a valid further iterate); the solve
               stops at the first read iteration whose own decision stops it
  none         no stop rule can fire (``tol: 0`` and no eta_min stop within the cap): the cap runs
               with no read inside the loop and one read at its end (non-finite or not)
The bookkeeping of an iteration (everything here but f) runs as PyTorch ops, or, where
``fused_wanted`` says (``solver.bookkeeping``; on CUDA by default), as the four Triton kernels of
:mod:`fpscale.solvers.fused`, with the same semantics.
Between reads a non-finite residual is remembered on the device (``torch.where``): the iterate,
residuals, damping and frozen tokens stay those of the last finite iteration, and the iteration
count reports the one that went non-finite, as the eager solve does.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Protocol

import torch

from fpscale.solvers.anderson import AndersonMixing, AttractorAnderson, min_iterations, sample_residual
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.fused import AVAILABLE as FUSED_AVAILABLE
from fpscale.solvers.fused import FUSED_ERROR, iterate_fused, runnable
from fpscale.solvers.loop_state import NEVER, Carry, IterateResult, check_step_output, state_dtype
from fpscale.solvers.stop_rule import (
    StopDecision,
    StopFlags,
    quantile_limit,
    read_schedule,
    stop_residual,
)

# A consensus callable takes a small int64 tensor of flags (StopFlags.pack) and returns their
# element-wise maximum over a process group, so every rank of that group takes the same decision.
Consensus = Callable[[torch.Tensor], torch.Tensor]
# An agreement sums a small int64 tensor over the data-parallel group (``solver.agree: dp``): the
# stop decision's counts [unconverged, movable, non-finite] of the whole DP micro-batch; ``size`` is
# the group's size (the quantile's batch is size x B).
class Agree(Protocol):
    size: int

    def __call__(self, counts: torch.Tensor) -> torch.Tensor: ...


# A state reduction completes per-token partial norms when the iterate itself is split over a
# process group (tensor-parallel channels): (tensor, "sum" | "max") -> the group's total.
StateReduce = Callable[[torch.Tensor, str], torch.Tensor]


def token_residual(new: torch.Tensor, old: torch.Tensor, norm: str, eps: float,
                   state_reduce: StateReduce | None = None) -> torch.Tensor:
    """Relative change per token: [B, T, ...] -> [B, T] (float32 or float64)."""
    dtype = state_dtype(new.dtype)
    diff = (new.to(dtype) - old.to(dtype))
    ref = new.to(dtype)
    diff, ref = (t.flatten(2) if t.dim() > 2 else t.unsqueeze(-1) for t in (diff, ref))
    if norm == "inf":
        parts = torch.stack([diff.abs().amax(-1), ref.abs().amax(-1)])
        if state_reduce is not None:
            parts = state_reduce(parts, "max")
        return parts[0] / (parts[1] + eps)
    if state_reduce is None:
        return torch.linalg.vector_norm(diff, dim=-1) / (torch.linalg.vector_norm(ref, dim=-1) + eps)
    sq = state_reduce(torch.stack([diff.pow(2).sum(-1), ref.pow(2).sum(-1)]), "sum").sqrt()
    return sq[0] / (sq[1] + eps)


def _per_token(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [B, T] mask against a [B, T, ...] tensor."""
    return mask.view(*mask.shape, *([1] * (like.dim() - 2)))


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [B] (per sample) or [B, T] (per token) tensor against a [B, T, ...] tensor."""
    return values.view(*values.shape, *([1] * (like.dim() - values.dim())))


def fresh_state(z0: torch.Tensor, cfg: SolverConfig, group: int = 1) -> Carry:
    """Algorithm 1's state at the start of a solve: damping, best residual and patience per unit
    ([B] with ``decisions: sample``, [B, T / group] with ``token``: ``group`` entries of the state
    per token, fpsa's heads with ``halting: head``), nothing frozen, residuals inf."""
    dtype, dev = state_dtype(z0.dtype), z0.device
    units = (z0.shape[0], z0.shape[1] // group) if cfg.decisions == "token" else (z0.shape[0],)
    return Carry(eta=torch.full(units, cfg.damping, dtype=dtype, device=dev),
                 best=torch.full(units, float("inf"), dtype=dtype, device=dev),
                 patience_left=torch.full(units, cfg.patience, dtype=torch.long, device=dev),
                 frozen=torch.zeros(z0.shape[:2], dtype=torch.bool, device=dev),
                 token_res=torch.full(z0.shape[:2], float("inf"), dtype=dtype, device=dev))


def _damped_step(z, fz, eta, anderson, by_token: bool, group: int = 1) -> torch.Tensor:
    """The next iterate before freezing: eta f(z) + (1 - eta) z, or Anderson's mix (per token with
    ``by_token``: each token is its own least-squares problem, so no token reads a later one)."""
    if by_token and group > 1:              # one eta per token, shared by its entries
        eta = eta.repeat_interleave(group, 1)
    if anderson is None:
        step_eta = _per_sample(eta, z)
        return step_eta * fz + (1 - step_eta) * z
    if by_token:
        rows = z.shape[0] * z.shape[1]
        return anderson.step(z.reshape(rows, 1, -1), fz.reshape(rows, 1, -1), eta.reshape(rows)).view_as(z)
    return anderson.step(z, fz, eta)


def iterate(step: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, cfg: SolverConfig,
            *, quantile: float, consensus: Consensus | None = None, state_reduce: StateReduce | None = None,
            max_iter: int | None = None, real: torch.Tensor | None = None,
            agree: Agree | None = None, carry: Carry | None = None, min_iter: int = 0,
            prefix: torch.Tensor | None = None, group: int = 1) -> IterateResult:
    """Run the damped fixed-point iteration of ``step`` from ``z0``.

    Gradients flow through the loop only if grad mode is on (the ``unroll`` backward);
    the stop decision always uses detached values. ``state_reduce`` is given when ``z`` is
    this rank's slice of a state split over a group (norms and Anderson's Gram are completed).
    ``step`` may compute in any dtype; its result is brought to the state dtype (float32).
    ``agree`` (``solver.agree: dp``): the stop decision is taken over the data-parallel group's
    samples, B on each of ``agree.size`` ranks, as one process would over all of them (one 3-int
    all-reduce per iteration); each sample's damping and patience stay its own.
    ``carry`` (a previous call's ``IterateResult.carry``): go on with that solve's damping, patience,
    best residuals and frozen tokens instead of starting afresh (always the PyTorch loop).
    ``min_iter``: no rule stops the solve before this many iterations (cached decoding).
    ``prefix`` [B] long (``decisions: token``, cached decoding): the iteration from which every token
    before this chunk is done (a previous solve's ``retired_at``; the prefix rule reads it as a
    token before the first). The result's ``retired_at`` [B] is the iteration at which the chunk's
    last token retired (``NEVER`` if it did not).
    ``group`` (``decisions: token``): entries of the state per token, laid out token-major ([B, T * group],
    fpsa's heads with ``halting: head``): the token is the unit of damping, patience and the prefix rule
    (its residual the max over its entries: the same units on every TP rank, whichever heads it holds),
    and an entry retires once every earlier token is done and the entry itself converged (the per-head
    selective update). The PyTorch loop only.
    """
    max_iter = cfg.max_iter if max_iter is None else max_iter
    tol = cfg.tol
    dtype = state_dtype(z0.dtype)
    B = z0.shape[0]
    z = z0.to(dtype)
    state = carry if carry is not None else fresh_state(z0, cfg, group)
    eta, best, patience_left, frozen, token_res = (state.eta, state.best, state.patience_left, state.frozen,
                                                   state.token_res)
    anderson = _make_anderson(cfg, state_reduce, max_iter)
    min_iter = max(min_iter, min_iterations(cfg, max_iter))     # the caller's (decoding) and the config's
    limit = quantile_limit(quantile, B * (agree.size if agree is not None else 1))
    every = read_schedule(cfg, max_iter)
    if carry is None and group == 1 and fused_wanted(cfg, z0):
        return iterate_fused(step, z0, cfg, every=every, limit=limit, consensus=consensus,
                             state_reduce=state_reduce, max_iter=max_iter, real=real, agree=agree,
                             min_iter=min_iter, prefix=prefix)
    if every != 1:
        return _iterate_deferred(step, z, cfg, every, limit, consensus, state_reduce, max_iter, real,
                                 eta, best, patience_left, frozen, token_res, anderson, agree, min_iter, prefix, group)
    by_token = cfg.decisions == "token"
    retired_at = torch.full((B,), NEVER, dtype=torch.long, device=z.device)
    stopped_by = "max_iter"
    k = 0
    for k in range(1, max_iter + 1):
        fz, res, counts, best, patience_left, next_eta = _observe(
            step, z, k, cfg, frozen, token_res, real, best, patience_left, eta, consensus, state_reduce, agree, group)
        with torch.no_grad():
            n_unconverged, movable = counts.sums()
            decision = StopDecision.read(n_unconverged, n_unconverged <= limit, movable == 0, counts.nonfinite)
        if decision.nonfinite:
            stopped_by = "nonfinite"
            break   # keep the last finite iterate z
        z_next = _damped_step(z, fz, eta, anderson, by_token, group)
        if by_token or cfg.freeze_converged:
            z_next = torch.where(_per_token(frozen, z), z, z_next)
            newly, prefix_done = counts.retire(res, tol, k, prefix, group)
            frozen = frozen | newly
            retired_at = torch.where(prefix_done & (retired_at == NEVER), k, retired_at)
        token_res = res.to(dtype)
        eta = next_eta
        z = z_next
        if k >= min_iter and (decision.quantile_met or decision.stalled):
            stopped_by = ("converged" if decision.unconverged == 0 else "quantile" if decision.quantile_met
                          else "eta_min")
            break
    if getattr(anderson, "returns_last_f", False) and stopped_by != "nonfinite" and k > 0:
        z = fz                       # Attractor's solve returns the last f(x) (fpscale.solvers.anderson)
    return IterateResult(z=z, iterations=k, stopped_by=stopped_by, token_res=token_res,
                         token_converged=token_res < tol, eta=eta,
                         carry=Carry(eta, best, patience_left, frozen, token_res), retired_at=retired_at)


def _make_anderson(cfg: SolverConfig, state_reduce, cap: int):
    """The Anderson mixing of ``cfg`` (``anderson_variant``), or None without Anderson."""
    if not cfg.anderson:
        return None
    if cfg.anderson_variant == "attractor":
        return AttractorAnderson(cfg.anderson, cfg.anderson_lambda, state_reduce, plain_only=cap < 3)
    return AndersonMixing(cfg.anderson, cfg.anderson_lambda, state_reduce)


def fused_wanted(cfg: SolverConfig, z: torch.Tensor) -> bool:
    """Whether this solve's bookkeeping runs as fpscale.solvers.fused's kernels (``solver.bookkeeping``):
    never with Anderson mixing, with autograd through the loop (the unroll backward's training
    solve) or for an empty state; else ``auto``: on CUDA where Triton imports, ``fused``: always
    (an error where the kernels cannot run), ``torch``: never."""
    if cfg.bookkeeping == "torch" or cfg.anderson or torch.is_grad_enabled() or z.numel() == 0:
        return False
    if cfg.norm == "sample_l2":      # one residual per sample: the PyTorch bookkeeping (SolverConfig.validate
        return False                 # rejects bookkeeping: fused with it, naming the key)
    if cfg.bookkeeping == "auto" and not z.is_cuda:
        return False
    if FUSED_ERROR is not None:
        error = FUSED_ERROR
        raise RuntimeError(f"solver.bookkeeping = {cfg.bookkeeping}: triton is installed but does not import "
                           f"({error!r}); reinstall it, or set solver.bookkeeping=torch") from error
    if cfg.bookkeeping == "fused" and not runnable(z):
        where = ("triton is not installed (pip install triton)" if not FUSED_AVAILABLE else
                 f"its kernels run on CUDA tensors, or on CPU under TRITON_INTERPRET=1 set before "
                 f"fpscale.solvers.fused is imported; this solve's state is on {z.device}")
        raise RuntimeError(f"solver.bookkeeping = fused: {where}. Use auto (fused on CUDA) or torch")
    if not FUSED_AVAILABLE:
        _warn_unfused_once()
        return False
    return True


@functools.cache
def _warn_unfused_once() -> None:
    warnings.warn("solver.bookkeeping = auto on CUDA without triton: every solver iteration runs its "
                  "bookkeeping as about 40 PyTorch kernels beside f (4 fused Triton kernels with triton; "
                  "bench/solver_overhead.py). pip install triton (a CUDA torch wheel brings it)", stacklevel=3)


def _observe(step, z, k: int, cfg: SolverConfig, frozen, token_res, real, best, patience_left, eta,
             consensus, state_reduce, agree, group: int = 1):
    """One application of f and what the iteration learns from it, without a host read: f(z) in the
    state dtype, the residual per token, the per-sample patience and damping after Algorithm 1 (from
    the flags agreed over the TP group), and the decision's device counts (unconverged samples,
    unconverged samples whose next eta is not below eta_min, non-finite: summed over the DP group
    with ``agree``). With ``decisions: token`` the flags, best residual, patience and damping are
    per token. Returns (fz, res, counts, best, patience_left, next_eta)."""
    fz = step(z)
    if k == 1:
        check_step_output(fz, z)
    fz = fz.to(z.dtype)
    with torch.no_grad():
        if cfg.norm == "sample_l2":          # one residual per sample, every token of it alike
            res = sample_residual(fz.detach(), z.detach(), real, state_reduce).to(z.dtype)
            res = res[:, None].expand(z.shape[:2])
        else:
            res = token_residual(fz.detach(), z.detach(), cfg.norm, cfg.eps, state_reduce)
        res = torch.where(frozen, token_res, res)
        if real is not None:                  # padding converges at once and stays frozen
            res = res.masked_fill(~real, 0.0)
        unit_res = (res.view(res.shape[0], -1, group).amax(-1) if cfg.decisions == "token" else res.amax(1))
        finite = torch.isfinite(unit_res)
        # flags this rank saw; under TP their MAX over the group is what every rank acts on
        flags = StopFlags(nonfinite=~finite.all(),
                          unconverged=~(stop_residual(cfg.stop_residual, unit_res, best) < cfg.tol),
                          no_progress=~(unit_res < best))
        if consensus is not None:
            flags = StopFlags.unpack(consensus(flags.pack()), tuple(best.shape))
        # Algorithm 1, per unit: progress resets the patience, stagnation decays eta
        best = torch.where(flags.no_progress, best, unit_res)
        if cfg.patience > 0:
            patience_left = torch.where(flags.no_progress, patience_left - 1, cfg.patience)
            decay_now = patience_left <= 0
            next_eta = torch.where(decay_now, eta * cfg.decay, eta)
            patience_left = torch.where(decay_now, cfg.patience, patience_left)
        else:
            next_eta = eta
        counts = _Counts(flags, next_eta, cfg.eta_min, agree)
    return fz, res, counts, best, patience_left, next_eta


class _Counts:
    """What the stop decision counts in one iteration, on the device: unconverged samples, unconverged
    samples whose next eta is not below eta_min, and whether a residual was non-finite. With ``agree``
    (solver.agree: dp) all three are summed over the DP group at once, every iteration (the non-finite
    flag is needed by every iteration); without it the two sums are made only where a read needs them."""

    def __init__(self, flags: StopFlags, next_eta: torch.Tensor, eta_min: float, agree):
        self.flags, self.next_eta, self.eta_min = flags, next_eta, eta_min
        self.summed = None
        if agree is not None:
            n_unconverged, movable, bad = agree(torch.stack([t.long() for t in (*self._local(), flags.nonfinite)]))
            self.summed = (n_unconverged, movable)
            self.nonfinite = bad > 0
        else:
            self.nonfinite = flags.nonfinite

    def _local(self) -> tuple[torch.Tensor, torch.Tensor]:
        unconverged = self.flags.unconverged
        movable = unconverged & ~(self.next_eta < self.eta_min)
        if unconverged.dim() == 2:       # per token: a sample is unconverged while one of its tokens is
            return unconverged.any(1).sum(), movable.any(1).sum()
        return unconverged.sum(), movable.sum()

    def retire(self, res: torch.Tensor, tol: float, k: int, prefix: torch.Tensor | None = None,
               group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] tokens frozen from the next iteration on. Per token (``decisions: token``) the prefix
        rule: token t retires once every token s <= t is done, converged (the agreed flag, so with
        ``stop_residual: best`` too) or stalled (its next eta below eta_min); the retired tokens are
        a prefix of the sample, so nothing a retired token reads moves after it. Per sample
        (``freeze_converged``) the tokens whose residual is below tol."""
        if self.flags.unconverged.dim() == 2:
            stalled = self.next_eta < self.eta_min
            done = ~self.flags.unconverged | stalled
            before = (prefix <= k) if prefix is not None else torch.ones_like(done[:, 0])
            # [B, 1 + T]: every entry so far done, as a count of the not-done ones (int32, not a uint8 cummin:
            # Inductor's Triton code for that held a uint8 constant -1 that Triton 3.6 refuses, so the chunk
            # never compiled on the first GPU run, torch 2.11)
            upto = (~torch.cat([before[:, None], done], 1)).to(torch.int32).cumsum(1) == 0
            if group == 1:
                return upto[:, 1:], upto[:, -1]
            own = (res < tol) | stalled.repeat_interleave(group, 1)     # an entry's own test (per head)
            return upto[:, :-1].repeat_interleave(group, 1) & own, upto[:, -1]
        return res < tol, torch.zeros_like(res[:, 0], dtype=torch.bool)

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unconverged samples, unconverged samples that can still move)."""
        return self.summed if self.summed is not None else self._local()


def _iterate_deferred(step, z, cfg: SolverConfig, every: int | None, limit: int, consensus, state_reduce,
                      max_iter: int, real, eta, best, patience_left, frozen, token_res, anderson,
                      agree, min_iter: int = 0, prefix=None, group: int = 1) -> IterateResult:
    """The loop of ``iterate`` reading the stop decision only at iterations ``every``, 2 ``every``,
    ... and the cap (``every`` None: at the cap only). The iterations are those of the eager loop;
    a non-finite residual is remembered on the device and holds the state at its last finite
    value (``alive``), so nothing but the scheduled reads waits for the device."""
    tol, dtype, by_token = cfg.tol, z.dtype, cfg.decisions == "token"
    alive = torch.ones((), dtype=torch.bool, device=z.device)       # no non-finite residual yet
    first_bad = torch.full((), max_iter, dtype=torch.long, device=z.device)
    stopped_by, k = "max_iter", 0
    retired_at = torch.full((z.shape[0],), NEVER, dtype=torch.long, device=z.device)
    for k in range(1, max_iter + 1):
        fz, res, counts, best, patience_left, next_eta = _observe(
            step, z, k, cfg, frozen, token_res, real, best, patience_left, eta, consensus, state_reduce, agree, group)
        with torch.no_grad():
            first_bad = torch.where(alive & counts.nonfinite, k, first_bad)
            alive = alive & ~counts.nonfinite
        z_next = _damped_step(z, fz, eta, anderson, by_token, group)
        if by_token or cfg.freeze_converged:     # a frozen token, or every token once a residual went non-finite
            z_next = torch.where(_per_token(frozen | ~alive, z), z, z_next)
            newly, prefix_done = counts.retire(res, tol, k, prefix, group)
            frozen = torch.where(alive, frozen | newly, frozen)
            retired_at = torch.where(alive & prefix_done & (retired_at == NEVER), k, retired_at)
        else:
            z_next = torch.where(alive, z_next, z)
        with torch.no_grad():
            token_res = torch.where(alive, res.to(dtype), token_res)
            eta = torch.where(alive, next_eta, eta)
        z = z_next
        if k == max_iter or (every is not None and k % every == 0):
            with torch.no_grad():
                n_unconverged, movable = counts.sums()
                decision, bad_at = StopDecision.read_lagged(n_unconverged, n_unconverged <= limit, movable == 0,
                                                            ~alive, first_bad)
            if decision.nonfinite:
                stopped_by, k = "nonfinite", bad_at
                break
            if every is not None and k >= min_iter and (decision.quantile_met or decision.stalled):
                stopped_by = ("converged" if decision.unconverged == 0 else "quantile" if decision.quantile_met
                              else "eta_min")
                break
    if getattr(anderson, "returns_last_f", False) and stopped_by != "nonfinite" and k > 0:
        z = fz                       # Attractor's solve returns the last f(x) (fpscale.solvers.anderson)
    return IterateResult(z=z, iterations=k, stopped_by=stopped_by, token_res=token_res,
                         token_converged=token_res < tol, eta=eta,
                         carry=Carry(eta, best, patience_left, frozen, token_res), retired_at=retired_at)
