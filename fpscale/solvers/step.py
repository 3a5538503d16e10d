"""The solver's one iteration: a function of a loop state and a solve context, written once.

Every execution mode runs ``advance`` (fpscale.solvers.chunked): the eager loop (a chunk of one iteration,
read every iteration), ``check_every: N`` (chunks of N, the stop tested at their last iteration), the
compiled chunk (``solver.chunk: K``, the stop tested every iteration, read once per chunk). Only the
fused Triton bookkeeping (fpscale.solvers.fused) stands in for the bookkeeping part with kernels.

One iteration from ``LoopState`` s at iteration k (a device scalar):
  active      s.running and k <= cap: an inactive iteration applies f and changes nothing
  observe     f(z), the residual per token (``norm`` inf / l2 per token; ``sample_l2`` one per sample),
              Algorithm 1's flags per unit (token or sample: ``decisions``), agreed over TP
              (``consensus``), best residual, patience and next damping, the decision's counts (summed
              over DP every iteration with ``agree``, or recorded for the chunk's deferred agreement)
  update      the damped step or Anderson mixing (its history a ring of tensors in the state), frozen
              entries held, the prefix rule's retirement; held on a non-finite residual (the last finite
              iterate is kept), or at a DP replay's non-finite k* (``bad_at``)
  stop        non-finite, or (where ``test``) k >= min_iter and the quantile met or every unit stalled:
              ``running`` falls, ``reason`` records why (``STOP_REASONS``), ``iters`` the iteration
The host reads [running, iters, reason] after a chunk (the schedule's one synchronisation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

import torch

from fpscale.solvers.anderson import mix, new_history, sample_residual
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.loop_state import NEVER, Carry, check_step_output, entry_changed, state_dtype
from fpscale.solvers.stats import STOP_REASONS
from fpscale.solvers.stop_rule import StopFlags, stop_residual

CONVERGED, QUANTILE, MAX_ITER, ETA_MIN, NONFINITE = (STOP_REASONS.index(r) for r in
                                                     ("converged", "quantile", "max_iter", "eta_min", "nonfinite"))

# A consensus callable takes a small int64 tensor of flags (StopFlags.pack) and returns their
# element-wise maximum over a process group, so every rank of that group takes the same decision.
Consensus = Callable[[torch.Tensor], torch.Tensor]
# A state reduction completes per-token partial norms when the iterate itself is split over a
# process group (tensor-parallel channels): (tensor, "sum" | "max") -> the group's total.
StateReduce = Callable[[torch.Tensor, str], torch.Tensor]


class Agree(Protocol):
    """Sums a small int64 tensor over the data-parallel group (``solver.agree: dp``): the stop decision's
    counts [unconverged, movable, non-finite] of the whole DP micro-batch; ``size`` is the group's size."""
    size: int

    def __call__(self, counts: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SolveContext:
    """What one solve call brings besides f, z0 and the config: the distributed agreement, padding, the
    decoding prefix, entry groups and the call's cap. ``solve(f, z0, config, context)``.

    consensus     MAX of the stop flags over the TP group (every rank iterates alike)
    state_reduce  completes per-token norms (and Anderson's Gram) where z is split over a group
    agree         sums the decision's counts over the DP group (``solver.agree: dp``)
    real          [B, T] bool: the tokens that count in the stop test (left padding does not)
    prefix        [B] long: the iteration from which the tokens before z0's are done (cached decoding)
    group         entries of z per token (fpsa's heads, ``halting: head``): the unit of ``decisions: token``
    min_iter      no stop rule ends the solve before this many iterations (cached decoding)
    max_iter      this call's cap (None: the config's, training or evaluation)
    on_final      called once the loop ended, before f is applied to z* (cached decoding's caches,
                  fpscale.layers.step_cache)
    count_entries the result counts, per entry (a row of z: a token, or fpsa's (token, head)), the iterations
                  that changed it (``IterateResult.entry_iters``, ``SolverStats.entry_iterations``: fpsa's
                  per-head counts; a head whose value reached its fixed point stops counting before its token
                  retires, the unit that freezes under ``decisions: token``)
    expect        the iterations this solve is expected to take (the layer's previous solve, with
                  ``solver.chunk_schedule: expected``): a chunked solve launches that many iterations'
                  chunks before its first host read (fpscale.solvers.chunked)
    """
    consensus: Consensus | None = None
    state_reduce: StateReduce | None = None
    agree: Agree | None = None
    real: torch.Tensor | None = None
    prefix: torch.Tensor | None = None
    group: int = 1
    min_iter: int = 0
    max_iter: int | None = None
    on_final: Callable[[], None] | None = None
    expect: int | None = None
    count_entries: bool = False


class LoopState(NamedTuple):
    """The loop's tensors between two iterations (a chunk's input and output)."""
    z: torch.Tensor               # the iterate, state dtype
    eta: torch.Tensor             # [B] or [B, T / group] damping per unit
    best: torch.Tensor            # lowest residual per unit
    patience_left: torch.Tensor   # long, per unit
    frozen: torch.Tensor          # [B, T] bool
    token_res: torch.Tensor       # [B, T] the last finite residual
    retired_at: torch.Tensor      # [B] long: the iteration the last token retired (NEVER)
    entry_iters: torch.Tensor | None   # [B, T] int32: iterations that changed each entry (count_entries)
    running: torch.Tensor         # [] bool
    iters: torch.Tensor           # [] long: iterations counted
    reason: torch.Tensor          # [] long: STOP_REASONS index (max_iter while running)
    hist_x: torch.Tensor | None   # Anderson's ring of iterates [rows, m, D] (None without Anderson)
    hist_f: torch.Tensor | None   # ... of f(iterates)
    hist_n: torch.Tensor | None   # [] long: pairs written
    last_f: torch.Tensor | None   # the last f(z) (Attractor's variant returns it)


def start_state(z0: torch.Tensor, cfg: SolverConfig, group: int = 1, carry: Carry | None = None,
                count_entries: bool = False) -> LoopState:
    """The state before the first iteration: a fresh Algorithm 1 state, or a previous call's ``carry``;
    ``count_entries``: with a per-entry count of the iterations that change it."""
    dtype, dev = state_dtype(z0.dtype), z0.device
    c = carry if carry is not None else fresh_state(z0, cfg, group)
    z = z0.to(dtype)

    def scalar(value, dt=torch.long):
        return torch.full((), value, dtype=dt, device=dev)

    hist_x, hist_f, hist_n = new_history(z, cfg) if cfg.anderson else (None, None, None)
    last_f = z.clone() if cfg.anderson and cfg.anderson_variant == "attractor" else None
    return LoopState(z, c.eta, c.best, c.patience_left, c.frozen, c.token_res,
                     torch.full((z0.shape[0],), NEVER, dtype=torch.long, device=dev),
                     torch.zeros(z0.shape[:2], dtype=torch.int32, device=dev) if count_entries else None,
                     scalar(True, torch.bool),
                     scalar(0), scalar(MAX_ITER), hist_x, hist_f, hist_n, last_f)


def fresh_state(z0: torch.Tensor, cfg: SolverConfig, group: int = 1) -> Carry:
    """Algorithm 1's state at the start of a solve: damping, best residual and patience per unit
    ([B] with ``decisions: sample``, [B, T / group] with ``token``), nothing frozen, residuals inf."""
    dtype, dev = state_dtype(z0.dtype), z0.device
    units = (z0.shape[0], z0.shape[1] // group) if cfg.decisions == "token" else (z0.shape[0],)
    return Carry(eta=torch.full(units, cfg.damping, dtype=dtype, device=dev),
                 best=torch.full(units, float("inf"), dtype=dtype, device=dev),
                 patience_left=torch.full(units, cfg.patience, dtype=torch.long, device=dev),
                 frozen=torch.zeros(z0.shape[:2], dtype=torch.bool, device=dev),
                 token_res=torch.full(z0.shape[:2], float("inf"), dtype=dtype, device=dev))


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


def per_token(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [B] or [B, T] tensor against a [B, T, ...] tensor."""
    return mask.view(*mask.shape, *([1] * (like.dim() - mask.dim())))


def observe(step, z, first: bool, cfg: SolverConfig, s: LoopState, ctx: SolveContext, consensus, agree):
    """One application of f and what the iteration learns from it, without a host read: f(z) in the
    state dtype, the residual per token, Algorithm 1's patience and damping per unit from the flags
    agreed over the TP group (``consensus``), and the decision's counts (summed over DP with ``agree``).
    Returns (fz, res, counts, best, patience_left, next_eta)."""
    fz = step(z)
    if first:
        check_step_output(fz, z)
    fz = fz.to(z.dtype)
    with torch.no_grad():
        if cfg.norm == "sample_l2":          # one residual per sample, every token of it alike
            res = sample_residual(fz.detach(), z.detach(), ctx.real, ctx.state_reduce).to(z.dtype)
            res = res[:, None].expand(z.shape[:2])
        else:
            res = token_residual(fz.detach(), z.detach(), cfg.norm, cfg.eps, ctx.state_reduce)
        res = torch.where(s.frozen, s.token_res, res)
        if ctx.real is not None:                  # padding converges at once and stays frozen
            res = res.masked_fill(~ctx.real, 0.0)
        unit_res = (res.view(res.shape[0], -1, ctx.group).amax(-1) if cfg.decisions == "token" else res.amax(1))
        best = s.best
        # flags this rank saw; under TP their MAX over the group is what every rank acts on
        flags = StopFlags(nonfinite=~torch.isfinite(unit_res).all(),
                          unconverged=~(stop_residual(cfg.stop_residual, unit_res, best) < cfg.tol),
                          no_progress=~(unit_res < best))
        if consensus is not None:
            flags = StopFlags.unpack(consensus(flags.pack()), tuple(best.shape))
        # Algorithm 1, per unit: progress resets the patience, stagnation decays eta
        best = torch.where(flags.no_progress, best, unit_res)
        patience_left, next_eta = s.patience_left, s.eta
        if cfg.patience > 0:
            patience_left = torch.where(flags.no_progress, patience_left - 1, cfg.patience)
            decay_now = patience_left <= 0
            next_eta = torch.where(decay_now, s.eta * cfg.decay, s.eta)
            patience_left = torch.where(decay_now, cfg.patience, patience_left)
        counts = Counts(flags, next_eta, cfg.eta_min, agree)
    return fz, res, counts, best, patience_left, next_eta


class Counts:
    """What the stop decision counts in one iteration, on the device: unconverged samples, unconverged
    samples whose next eta is not below eta_min, and whether a residual was non-finite. With ``agree``
    (solver.agree: dp, every iteration) all three are summed over the DP group at once."""

    def __init__(self, flags: StopFlags, next_eta: torch.Tensor, eta_min: float, agree):
        self.flags, self.next_eta, self.eta_min = flags, next_eta, eta_min
        self.summed = None
        self.nonfinite = flags.nonfinite
        if agree is not None:
            n_unconverged, movable, bad = agree(torch.stack([t.long() for t in (*self._local(), flags.nonfinite)]))
            self.summed, self.nonfinite = (n_unconverged, movable), bad > 0

    def _local(self) -> tuple[torch.Tensor, torch.Tensor]:
        unconverged = self.flags.unconverged
        movable = unconverged & ~(self.next_eta < self.eta_min)
        if unconverged.dim() == 2:       # per token: a sample is unconverged while one of its tokens is
            return unconverged.any(1).sum(), movable.any(1).sum()
        return unconverged.sum(), movable.sum()

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unconverged samples, unconverged samples that can still move)."""
        return self.summed if self.summed is not None else self._local()

    def retire(self, res: torch.Tensor, tol: float, k, prefix: torch.Tensor | None = None,
               group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] entries frozen from the next iteration on, and [B] whether the last token retired. Per
        token (``decisions: token``) the prefix rule: token t retires once every token s <= t is done,
        converged (the agreed flag) or stalled (its next eta below eta_min); with ``group`` an entry
        retires once every earlier token is done and the entry itself converged. Per sample
        (``freeze_converged``) the tokens whose residual is below tol."""
        if self.flags.unconverged.dim() == 2:
            stalled = self.next_eta < self.eta_min
            done = ~self.flags.unconverged | stalled
            before = (prefix <= k) if prefix is not None else torch.ones_like(done[:, 0])
            # [B, 1 + T]: every entry so far done, as a count of the not-done ones (int32, not a uint8 cummin:
            # Inductor's Triton code for that held a uint8 constant -1 that Triton 3.6 refuses, torch 2.11)
            upto = (~torch.cat([before[:, None], done], 1)).to(torch.int32).cumsum(1) == 0
            if group == 1:
                return upto[:, 1:], upto[:, -1]
            own = (res < tol) | stalled.repeat_interleave(group, 1)     # an entry's own test (per head)
            return upto[:, :-1].repeat_interleave(group, 1) & own, upto[:, -1]
        return res < tol, torch.zeros_like(res[:, 0], dtype=torch.bool)


def damped(z, fz, eta, by_token: bool, group: int) -> torch.Tensor:
    """eta f(z) + (1 - eta) z, eta per sample or per token (shared by a token's ``group`` entries)."""
    if by_token and group > 1:
        eta = eta.repeat_interleave(group, 1)
    step_eta = per_token(eta, z)
    return step_eta * fz + (1 - step_eta) * z


def stop_code(nonfinite: bool, unconverged: int, met: bool, stalled: bool, testable: bool) -> int | None:
    """The stop rule on host values (the eager loop's read), as ``advance`` applies it on the device in a
    chunk: the ``STOP_REASONS`` index of a stop, or None to go on."""
    if nonfinite:
        return NONFINITE
    if testable and (met or stalled):
        return CONVERGED if unconverged == 0 else QUANTILE if met else ETA_MIN
    return None


def advance(step, s: LoopState, k, first: bool, cfg: SolverConfig, ctx: SolveContext, *,
            cap, min_iter, limit, test, consensus=None, agree=None, bad_at=None, masked: bool = True):
    """One iteration of every mode (module docstring). ``k``, ``cap``, ``min_iter``, ``limit``: device
    scalars (a compiled chunk) or ints (eager). ``test``: whether the stop rule is tested at this
    iteration; ``bad_at`` (a chunk deferring its DP agreement): the stop is off but for the cap, and no
    update at iteration ``bad_at``. ``masked`` False (the eager loop: one iteration per read, never past
    the stop): the update is not held by masks; on a non-finite residual the caller keeps the state it
    passed in. Returns (state, counts, active)."""
    by_token, tol = cfg.decisions == "token", cfg.tol
    active: Any = s.running & (k <= cap) if masked else True       # a device bool, or True
    fz, res, counts, new_best, new_left, next_eta = observe(step, s.z, first, cfg, s, ctx, consensus, agree)
    with torch.no_grad():
        n_unconverged, movable = counts.sums()
        nonfinite = counts.nonfinite
        # the eager rule: no update on a non-finite residual (under deferred DP: at the group's k*)
        update: Any = (active & ((k != bad_at) if bad_at is not None else ~nonfinite)) if masked else True
        best = torch.where(active, new_best, s.best) if masked else new_best
        patience_left = torch.where(active, new_left, s.patience_left) if masked else new_left
    hist_x, hist_f, hist_n, last_f = s.hist_x, s.hist_f, s.hist_n, s.last_f
    if cfg.anderson:
        z_next, hist_x, hist_f, hist_n = mix(s.z, fz, s.eta, s.hist_x, s.hist_f, s.hist_n, update, cfg,
                                             by_token, ctx.state_reduce, ctx.group, cap)
    else:
        z_next = damped(s.z, fz, s.eta, by_token, ctx.group)
    if last_f is not None:
        last_f = torch.where(update, fz, last_f) if masked else fz
    frozen, retired_at, entry_iters = s.frozen, s.retired_at, s.entry_iters
    if by_token or cfg.freeze_converged:
        z_next = torch.where(per_token(frozen, s.z), s.z, z_next)
    z = torch.where(update, z_next, s.z) if masked else z_next

    def held(new, old):
        return torch.where(update, new, old) if masked else new
    with torch.no_grad():
        if by_token or cfg.freeze_converged:
            newly, prefix_done = counts.retire(res, tol, k, ctx.prefix, ctx.group)
            frozen = held(frozen | newly, frozen)
            retired_at = torch.where(update & prefix_done & (retired_at == NEVER), k, retired_at)
        if entry_iters is not None:     # the steps in which each entry changed (held or frozen: it does not)
            entry_iters = entry_iters + entry_changed(z, s.z)
        token_res = held(res.to(s.token_res.dtype), s.token_res)
        eta = held(next_eta, s.eta)
        iters = torch.where(active, k, s.iters) if masked else s.iters      # (eager: the host counts)
        running, reason = s.running, s.reason
        if bad_at is None and masked and test is False:      # check_every between reads: non-finite only
            stop = active & nonfinite
            reason = torch.where(stop, NONFINITE, reason)
            running = running & ~stop
        elif bad_at is None and masked:    # (eager: the host applies the same rule to the read: ``stop_code``)
            met, stalled = n_unconverged <= limit, movable == 0
            stop = active & (nonfinite | (test & (k >= min_iter) & (met | stalled)))
            code = torch.where(nonfinite, NONFINITE, torch.where(n_unconverged == 0, CONVERGED,
                                                                 torch.where(met, QUANTILE, ETA_MIN)))
            reason = torch.where(stop, code, reason)
            running = running & ~stop
    state = LoopState(z, eta, best, patience_left, frozen, token_res, retired_at, entry_iters, running, iters, reason,
                      hist_x, hist_f, hist_n, last_f)
    return state, counts, active
