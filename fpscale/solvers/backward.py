"""Backward modes at the fixed point z* (docs/solver.md; the papers in docs/references.md).

implicit  one differentiable application fz = f(z*) is recorded; a hook on fz replaces the
          incoming gradient g by the adjoint u solving u = J^T u + g (J = df/dz at z*),
          by the same damped iteration as the forward. Autograd then carries u through
          f's graph: dL/dtheta = (df/dtheta)^T u, dL/dx = (df/dx)^T u. Memory: one f.
          Tokens that did not converge are masked out of the adjoint (seed 000, App. D).
          With ``backward_freeze`` the adjoint solve applies the selective update: an entry of u
          whose own residual fell below backward_tol is frozen (seed 000, App. C.3: "The same
          selective update rule and convergence criteria (tol, max_iter) are applied to the
          adjoint solve"); per token, or per (token, head) where the state is laid out so (fpsa).
neumann1  implicit with the adjoint cut to its first Neumann term, u = g + J^T g: one vector-Jacobian
          product, no masking, no damping, no tolerance (jacobfa/Attractor's ``onestep`` backward,
          attractor/models/attractor/attractor.py:65-70, without its optional ``adjoint_clip``).
          Only a non-finite sample's rows are dropped, as implicit with ``mask_unconverged`` off does.
phantom   k differentiable applications of f starting at the detached z* (seed 004, Prop. 1).
jfb       phantom with k = 1.
unroll    handled by the solver: autograd through every forward iteration.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fpscale.solvers.chunked import run_loop
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.stats import SolverStats
from fpscale.solvers.step import Agree, Consensus, StateReduce
from fpscale.solvers.step import per_token as _per_token


class VjpStep:
    """The adjoint's step u -> J^T u + g (masked) by ``torch.func.vjp`` of f at z* (``solver.adjoint.adjoint_step:
    vjp``) instead of ``torch.autograd.grad`` of the recorded f(z*): dynamo traces it, so a chunked adjoint
    (solver.chunk) compiles; on the tiny configs in float64 it equals the recorded adjoint exactly
    (bench/adjoint_vjp.py; fpmamba's adjoint chunk still breaks the graph in the scan's backward, and the
    Triton scan (CUDA) is not in torch.func's form yet). Off by default until measured on a GPU.
    ``per_chunk`` linearises f once and returns the step for a chunk's K applications
    (fpscale.solvers.chunked calls it at the start of each chunk: f runs forward once per chunk, in
    the compiled graph too); called directly (the eager loop), it linearises at every application."""

    def __init__(self, f, z_star: torch.Tensor, g: torch.Tensor, mask: torch.Tensor):
        self.f, self.z_star, self.g, self.mask = f, z_star, g, mask

    def per_chunk(self) -> Callable[[torch.Tensor], torch.Tensor]:
        _, pull = torch.func.vjp(lambda z: self.f(z).to(z.dtype), self.z_star)[:2]     # (output, pullback)
        g, mask = self.g, self.mask

        def step(u: torch.Tensor) -> torch.Tensor:
            (vjp,) = pull(u)
            return (vjp + g) * mask
        return step

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        return self.per_chunk()(u)


def attach_implicit(f: Callable[[torch.Tensor], torch.Tensor], z_star: torch.Tensor, cfg: SolverConfig,
                    stats: SolverStats, consensus: Consensus | None,
                    state_reduce: StateReduce | None = None, agree: Agree | None = None) -> torch.Tensor:
    """Return a tensor equal to z* whose backward is the implicit-function-theorem gradient.
    z* is in the solver's state dtype; so are f(z*) here and the adjoint iterate."""
    z_in = z_star.detach().requires_grad_()
    fz = f(z_in).to(z_in.dtype)
    neumann1 = cfg.backward == "neumann1"
    if cfg.mask_unconverged and cfg.tol > 0 and not neumann1:
        keep = stats.token_converged
    # (with tol 0, a fixed depth, no token ever counts as converged: masking would drop every gradient,
    # so only non-finite samples are masked, as with mask_unconverged off)
    else:
        keep = torch.isfinite(stats.sample_residual)[:, None].expand_as(stats.token_converged)
    if stats.nonfinite:         # a token whose f(z*) is not finite gets no gradient (the forward kept z*)
        keep = keep & torch.isfinite(fz.detach()).reshape(*keep.shape, -1).all(-1)
    mask = _per_token(keep, fz).to(fz.dtype)
    # the adjoint tests its current residual whatever the forward's ``stop_residual``: a best-so-far
    # test could end it on an adjoint that has since moved away. Its damping is per sample whatever
    # the forward's ``decisions``: the adjoint runs backward in time (u_t gathers the gradients of
    # tokens >= t), so causality is no rule for it, and ``backward_freeze`` alone decides its freezing
    adjoint_cfg = dataclasses.replace(cfg, forward=dataclasses.replace(
        cfg.forward, max_iter=cfg.backward_max_iter, tol=cfg.backward_tol, stop_quantile=0.0,
        freeze_converged=cfg.backward_freeze, decisions="sample", min_iter=cfg.backward_min_iter),
        compat=dataclasses.replace(cfg.compat, stop_residual="current"))

    def adjoint_hook(grad: torch.Tensor) -> torch.Tensor:
        g = grad * mask
        if neumann1:
            (vjp,) = torch.autograd.grad(fz, z_in, g, retain_graph=True)
            u = (vjp + g) * mask
            with torch.no_grad():      # the size of the Neumann term: how far J^T is from 0 here
                stats.backward_iterations = 1
                stats.backward_residual = (vjp * mask).norm() / u.norm().clamp_min(1e-30)
            return u

        def adjoint_step(u: torch.Tensor) -> torch.Tensor:
            (vjp,) = torch.autograd.grad(fz, z_in, u, retain_graph=True)
            return (vjp + g) * mask

        if cfg.adjoint_step == "vjp":
            adjoint_step = VjpStep(f, z_in.detach(), g, mask)       # noqa: F811 (solver.adjoint.adjoint_step: vjp)

        with torch.no_grad():
            result = run_loop(adjoint_step, g, adjoint_cfg, quantile=0.0, consensus=consensus,
                              state_reduce=state_reduce, agree=agree)
        stats.backward_iterations = result.iterations
        # a device scalar: read with the other statistics at a log step, never here
        stats.backward_residual = (result.token_res.max() if result.token_res.numel()
                                   else result.token_res.new_zeros(()))
        return result.z

    # The hook sits on an alias of fz that only the outer graph reaches: the adjoint's own
    # vector-Jacobian products (autograd.grad of fz) must not re-enter it.
    fz_out = fz.view_as(fz)
    fz_out.register_hook(adjoint_hook)
    # Value exactly z* (what the forward found, frozen tokens bit-identical); gradient of f(z*).
    delta = fz_out - fz_out.detach()
    if stats.nonfinite:
        delta = torch.where(mask.bool(), delta, torch.zeros_like(delta))
    return z_star.detach() + delta


def phantom(f: Callable[[torch.Tensor], torch.Tensor], z_star: torch.Tensor, steps: int) -> torch.Tensor:
    """k differentiable steps of f from the detached fixed point (in the state dtype)."""
    z = z_star.detach()
    for _ in range(steps):
        z = f(z).to(z_star.dtype)
    return z
