"""Attractor's Anderson variant (``solver.anderson_variant: attractor``) and its whole-sample residual
(``solver.norm: sample_l2``): the solver jacobfa/Attractor runs (commit fcf045f,
attractor/models/attractor/solvers.py), as settings of fpscale's one solver loop
(fpscale.solvers.iterate), so TP consensus, DP agreement, host-read schedules, statistics and the
implicit backward serve it as they serve every other solve.

What differs from fpscale's default Anderson mixing (``fpscale.solvers.iterate._Anderson``):
  * lambda is absolute: H = G G^T + lambda I (solvers.py:72-75); fpscale scales it by the Gram's
    mean diagonal
  * the (m + 1) x (m + 1) bordered system is solved in float32 whatever the state's dtype
    (solvers.py:76-78: ``H.float()``, ``torch.linalg.solve_ex``); fpscale solves in float64
  * the window is a ring of m slots filled in order (pair j in slot j mod m, solvers.py:100-102), so
    the Gram has their row order and a float32 solve rounds as theirs does
  * two plain steps come first: x1 = f(x0), then mixing from the third application on; no stop test
    reads the first two residuals (solvers.py:49-52, 67-69): ``iterate`` raises min_iter to 3
  * the solve returns the last f(x), not the mixed next iterate (solvers.py:116)
  * a non-finite alpha falls back to the plain step on the ring's last slot, per sample
    (solvers.py:88-93). Deviations: a singular system is not retried with ``lstsq`` (solvers.py:79-85
    reads a flag on the host every iteration; here its non-finite alpha takes the fallback), and a
    non-finite mixed iterate is left to fpscale's non-finite stop (keeps the last finite iterate)
    instead of their "previous f" substitute (solvers.py:98-99); neither happens in a converging solve
  * beta (solvers.py:95-97) is fpscale's per-sample damping eta: beta F alpha + (1 - beta) X alpha
  * a cap below 3 iterates plainly: their model switches to fixed-point iteration then
    (attractor.py:342-343)

``sample_residual``: ||f(x) - x||_2 / max(||x||_2, 1e-9) over each whole sample, in float32
(solvers.py:4-9): one number per sample, against the previous iterate x (fpscale's per-token
residuals divide by ||f(x)||). Left padding is excluded (``real``); under tensor parallelism with a
split state the squared sums are completed over the group.
"""
from __future__ import annotations

import torch

PLAIN_STEPS = 2         # applications of f before the first mixing (and the first stop test)


def sample_residual(new: torch.Tensor, old: torch.Tensor, real: torch.Tensor | None = None,
                    state_reduce=None) -> torch.Tensor:
    """[B] relative change of each whole sample, in float32 (Attractor's ``_rel_residual``)."""
    diff, ref = new.float() - old.float(), old.float()
    if real is not None:
        keep = real.view(*real.shape, *([1] * (new.dim() - 2)))
        diff, ref = diff * keep, ref * keep
    if state_reduce is None:
        return diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-9)
    sq = state_reduce(torch.stack([diff.flatten(1).pow(2).sum(1), ref.flatten(1).pow(2).sum(1)]), "sum").sqrt()
    return sq[0] / sq[1].clamp_min(1e-9)


class AttractorAnderson:
    """Type-II Anderson mixing over a ring of ``window`` (x, f(x)) pairs, as Attractor mixes them."""

    returns_last_f = True

    def __init__(self, window: int, lam: float, state_reduce=None, plain_only: bool = False):
        self.window, self.lam, self.state_reduce, self.plain_only = window, lam, state_reduce, plain_only
        self.X: torch.Tensor | None = None
        self.F: torch.Tensor | None = None
        self.count = 0

    def step(self, z: torch.Tensor, fz: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
        """The next iterate after the pair (z, f(z)); ``eta`` [B] is beta, per sample."""
        B = z.shape[0]
        if self.X is None or self.F is None:
            self.X = z.new_zeros(B, self.window, z[0].numel())
            self.F = z.new_zeros(B, self.window, z[0].numel())
        ring_x, ring_f = self.X, self.F
        slot = self.count % self.window
        ring_x[:, slot] = z.reshape(B, -1)
        ring_f[:, slot] = fz.reshape(B, -1)
        self.count += 1
        if self.count < PLAIN_STEPS or self.plain_only:
            return fz.clone()
        n = min(self.count, self.window)
        X, F = ring_x[:, :n], ring_f[:, :n]
        G = F - X
        gram = torch.bmm(G, G.transpose(1, 2))
        if self.state_reduce is not None:         # the state is split over ranks: sum the partial Gram
            gram = self.state_reduce(gram, "sum")
        H = z.new_zeros(B, n + 1, n + 1)
        H[:, 0, 1:] = 1.0
        H[:, 1:, 0] = 1.0
        H[:, 1:, 1:] = gram + self.lam * torch.eye(n, device=z.device, dtype=z.dtype)[None]
        rhs = z.new_zeros(B, n + 1, 1)
        rhs[:, 0] = 1.0
        sol, _ = torch.linalg.solve_ex(H.float(), rhs.float())
        alpha = sol.to(z.dtype)[:, 1:n + 1, 0]
        plain = torch.zeros_like(alpha)
        plain[:, -1] = 1.0
        alpha = torch.where(torch.isfinite(alpha).all(dim=-1, keepdim=True), alpha, plain)
        beta = eta[:, None]
        mixed = beta * (alpha[..., None] * F).sum(dim=1) + (1.0 - beta) * (alpha[..., None] * X).sum(dim=1)
        return mixed.view_as(z)


def min_iterations(cfg, cap: int) -> int:
    """The applications of f before a convergence stop may fire: ``min_iter`` (the adjoint passes its
    own), at least 3 under the attractor variant (its first two residuals are never tested), clipped
    to the cap (attractor.py:340)."""
    floor = cfg.min_iter
    if cfg.anderson and cfg.anderson_variant == "attractor" and cap >= PLAIN_STEPS + 1:
        floor = max(floor, PLAIN_STEPS + 1)
    return min(floor, cap)
