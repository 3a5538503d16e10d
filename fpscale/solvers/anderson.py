"""Attractor's Anderson variant (``solver.compat.anderson_variant: attractor``) and its whole-sample residual
(``solver.forward.norm: sample_l2``): the solver jacobfa/Attractor runs (commit fcf045f,
attractor/models/attractor/solvers.py), as settings of fpscale's one solver loop
(fpscale.solvers.step), so TP consensus, DP agreement, host-read schedules, statistics and the
implicit backward serve it as they serve every other solve.

Both variants are ``mix`` (below): the history a ring of tensors in the loop state, so Anderson runs in
every execution mode (eager, check_every, compiled chunks). What differs from fpscale's default:
  * lambda is absolute: H = G G^T + lambda I (solvers.py:72-75); fpscale scales it by the Gram's
    mean diagonal
  * the (m + 1) x (m + 1) bordered system is solved in float32 whatever the state's dtype
    (solvers.py:76-78: ``H.float()``, ``torch.linalg.solve_ex``); fpscale solves in float64
  * the window is a ring of m slots filled in order (pair j in slot j mod m, solvers.py:100-102), so
    the Gram has their row order and a float32 solve rounds as theirs does
  * two plain steps come first: x1 = f(x0), then mixing from the third application on; no stop test
    reads the first two residuals (solvers.py:49-52, 67-69): ``min_iterations`` raises min_iter to 3
  * the solve returns the last f(x), not the mixed next iterate (solvers.py:116)
  * a non-finite alpha falls back to the plain step on the ring's last slot, per sample
    (solvers.py:88-93). Deviations: a singular system is not retried with ``lstsq`` (solvers.py:79-85
    reads a flag on the host every iteration; here its non-finite alpha takes the fallback), and a
    non-finite mixed iterate is left to fpscale's non-finite stop (keeps the last finite iterate)
    instead of their "previous f" substitute (solvers.py:98-99); neither happens in a converging solve
  * beta (solvers.py:95-97) is fpscale's per-sample damping eta: beta F alpha + (1 - beta) X alpha
  * a cap below 3 iterates plainly: their model switches to fixed-point iteration then
    (attractor.py:342-343)
(``solvers.py:N``, ``attractor.py:N``: lines of their attractor/models/attractor/, not fpscale's files.)
fpscale's variant is bit for bit the list-based window it was before the history became tensors (issue 47:
the ring read oldest first); its system is solved with ``solve_ex`` (no host read): a singular one gives a
non-finite iterate, which the non-finite stop catches, where ``solve`` raised.

``sample_residual``: ||f(x) - x||_2 / max(||x||_2, 1e-9) over each whole sample, in float32
(solvers.py:4-9; a float64 state keeps float64, fpscale's deviation so a float64 reference solve reaches
float64's resolution, issue 48): one number per sample, against the previous iterate x (fpscale's per-token
residuals divide by ||f(x)||). Left padding is excluded (``real``); under tensor parallelism with a
split state the squared sums are completed over the group.
"""
from __future__ import annotations

import torch

PLAIN_STEPS = 2         # applications of f before the first mixing (and the first stop test)


def sample_residual(new: torch.Tensor, old: torch.Tensor, real: torch.Tensor | None = None,
                    state_reduce=None) -> torch.Tensor:
    """[B] relative change of each whole sample, in float32 (Attractor's ``_rel_residual``); float64 for
    a float64 state (theirs casts to float32 whatever the state: a float64 solve would stop at 7e-8)."""
    dtype = torch.promote_types(new.dtype, torch.float32)
    diff, ref = new.to(dtype) - old.to(dtype), old.to(dtype)
    if real is not None:
        keep = real.view(*real.shape, *([1] * (new.dim() - 2)))
        diff, ref = diff * keep, ref * keep
    if state_reduce is None:
        return diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-9)
    sq = state_reduce(torch.stack([diff.flatten(1).pow(2).sum(1), ref.flatten(1).pow(2).sum(1)]), "sum").sqrt()
    return sq[0] / sq[1].clamp_min(1e-9)


def min_iterations(cfg, cap: int) -> int:
    """The applications of f before a convergence stop may fire: ``min_iter`` (the adjoint passes its
    own), at least 3 under the attractor variant (its first two residuals are never tested), clipped
    to the cap (attractor.py:340)."""
    floor = cfg.min_iter
    if cfg.anderson and cfg.anderson_variant == "attractor" and cap >= PLAIN_STEPS + 1:
        floor = max(floor, PLAIN_STEPS + 1)
    return min(floor, cap)


def new_history(z: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty rings of ``cfg.anderson`` (x, f(x)) pairs: [rows, m, D] (rows: samples, or tokens with
    ``decisions: token``: each token its own least-squares problem), and the count of pairs written."""
    rows = z.shape[0] * (z.shape[1] if cfg.decisions == "token" else 1)
    ring = z.new_zeros(rows, cfg.anderson, z.numel() // max(rows, 1))
    return ring, ring.clone(), torch.zeros((), dtype=torch.long, device=z.device)


def mix(z, fz, eta, X, F, n, update, cfg, by_token: bool, state_reduce=None, group: int = 1, cap=None):
    """Type-II Anderson mixing with its history as tensors: the pair (z, f(z)) is written to slot n mod m
    where ``update`` (a device bool: a chunk's inactive iteration leaves the rings as they were), then
    alpha solves the bordered least-squares system over the slots written so far (the others get
    alpha 0: identity rows, so the system of the written slots is the one solved) and
    z' = eta (F alpha) + (1 - eta) (X alpha), eta per row. Variants (``cfg.anderson_variant``):
    fpscale: lambda relative to the Gram's mean diagonal, solved in float64, one pair: the damped step.
    attractor: lambda absolute, solved in float32, the first PLAIN_STEPS - 1 applications (or a cap
    below 3: ``cap`` a device scalar) plain f(z), a non-finite alpha the plain step on the ring's last
    written slot. Returns (z', X, F, n). No host read: the same code eager and in a compiled chunk."""
    m = X.shape[1]
    rows = X.shape[0]
    if by_token and group > 1:              # one eta per token, shared by its entries
        eta = eta.repeat_interleave(group, 1)
    x, f, beta = z.reshape(rows, -1), fz.reshape(rows, -1), eta.reshape(rows, 1)
    slots = torch.arange(m, device=z.device)
    write = ((slots == n % m) & update)[None, :, None]
    X, F = torch.where(write, x[:, None], X), torch.where(write, f[:, None], F)
    n = n + (update.long() if isinstance(update, torch.Tensor) else int(update))
    filled = torch.clamp(n, max=m)
    valid = slots < filled                                              # [m]
    attractor = cfg.anderson_variant == "attractor"
    Xs, Fs = X, F                           # the attractor variant: in ring order, as theirs
    if not attractor:                       # fpscale: oldest pair first (the order of its window before the ring)
        order = (torch.clamp(n - m, min=0) + slots) % m
        Xs, Fs = X.index_select(1, order), F.index_select(1, order)
    solve_dtype = z.dtype if attractor else torch.float64      # attractor: the Gram in z's dtype, solved in float32
    G = torch.where(valid[None, :, None], Fs - Xs, 0).to(solve_dtype)
    gram = G @ G.transpose(1, 2)
    if state_reduce is not None:             # the state is split over ranks: sum the partial Gram
        gram = state_reduce(gram, "sum")
    eye = torch.eye(m, dtype=solve_dtype, device=z.device)
    lam = torch.tensor(cfg.anderson_lambda, dtype=solve_dtype, device=z.device)
    if not attractor:
        lam = lam * (gram.diagonal(dim1=1, dim2=2).sum(-1) / filled).clamp_min(1e-30)[:, None, None]
    inner = torch.where((valid[:, None] & valid[None, :])[None], gram + lam * eye, eye)
    border = valid.to(solve_dtype)[None, :].expand(rows, m)
    H = torch.cat([torch.cat([border.new_zeros(rows, 1), border], 1)[:, None],
                   torch.cat([border[..., None], inner], 2)], 1)
    rhs = torch.zeros(rows, m + 1, 1, dtype=solve_dtype, device=z.device)
    rhs[:, 0] = 1
    if attractor:
        H, rhs = H.float(), rhs.float()
    alpha = torch.linalg.solve_ex(H, rhs)[0][:, 1:, 0].to(z.dtype)        # [rows, m]
    if attractor:
        last = (slots == filled - 1).to(z.dtype)[None].expand(rows, m)
        alpha = torch.where(torch.isfinite(alpha).all(dim=-1, keepdim=True), alpha, last)
    if attractor:
        mixed = beta * (alpha[..., None] * F).sum(1) + (1 - beta) * (alpha[..., None] * X).sum(1)
    else:
        mixed = beta * (alpha[:, None] @ Fs)[:, 0] + (1 - beta) * (alpha[:, None] @ Xs)[:, 0]
    if attractor:
        plain = n < PLAIN_STEPS if cap is None else (n < PLAIN_STEPS) | (cap < PLAIN_STEPS + 1)
        mixed = torch.where(plain, f, mixed)
    else:
        mixed = torch.where(n == 1, beta * f + (1 - beta) * x, mixed)
    return mixed.view_as(z), X, F, n
