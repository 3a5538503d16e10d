"""The solver switches for jacobfa/Attractor's solve (issue 38) against hand-written float64 references:
``norm: sample_l2``, ``min_iter``, ``anderson_variant: attractor``, ``backward: neumann1`` and the
Anderson adjoint, in the eager loop and with every-N host reads."""
from __future__ import annotations

import pytest
import torch

from fpscale.errors import ConfigError
from fpscale.solvers import SolverConfig, solve
from fpscale.solvers.anderson import sample_residual

ATTRACTOR = dict(anderson=5, anderson_variant="attractor", norm="sample_l2", decisions="sample", stop_quantile=0.0,
                 patience=0,
                 eta_min=0.0, mask_unconverged=False)


def tanh_map(scales=(0.3, 0.6, 0.85), T=4, D=8, seed=0):
    """f(z) = tanh(z W_b + x_b): sample b contracts by about ``scales[b]``."""
    g = torch.Generator().manual_seed(seed)
    B = len(scales)
    W = torch.randn(B, D, D, generator=g, dtype=torch.float64)
    W = W / torch.linalg.matrix_norm(W, 2)[:, None, None] * torch.tensor(scales, dtype=torch.float64)[:, None, None]
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64).requires_grad_()
    return (lambda z: torch.tanh(z @ W + x)), x, W


def reference_attractor_solve(f, y0, max_iter, tol, m=5, beta=1.0, lam=1e-4, min_iter=0):
    """Attractor's solve written out per sample with plain lists: f(y0), f(f(y0)), then type-II
    Anderson over the last m pairs (the bordered system in float32, lambda absolute), the residual
    ||f(x) - x|| / ||x|| of each whole sample in float32, stop once every sample is below tol and at
    least max(min_iter, 3) applications ran; the answer is the last f(x)."""
    B = y0.shape[0]
    xs = [y0.reshape(B, -1)]
    fs = [f(y0).reshape(B, -1)]
    xs.append(fs[0])
    fs.append(f(fs[0].view_as(y0)).reshape(B, -1))
    iters = 2
    for k in range(2, max_iter):
        new = []
        for b in range(B):
            X = torch.stack([x[b] for x in xs[-m:]])
            F = torch.stack([fx[b] for fx in fs[-m:]])
            G = F - X
            n = G.shape[0]
            H = torch.zeros(n + 1, n + 1, dtype=torch.float64)
            H[0, 1:] = H[1:, 0] = 1.0
            H[1:, 1:] = G @ G.T + lam * torch.eye(n, dtype=torch.float64)
            rhs = torch.zeros(n + 1, dtype=torch.float64)
            rhs[0] = 1.0
            alpha = torch.linalg.solve(H.float(), rhs.float()).double()[1:]
            new.append(beta * alpha @ F + (1 - beta) * alpha @ X)
        x = torch.stack(new)
        xs.append(x)
        fs.append(f(x.view_as(y0)).reshape(B, -1))
        iters = k + 1
        res = (fs[-1].float() - x.float()).norm(dim=1) / x.float().norm(dim=1).clamp_min(1e-9)
        if iters >= min_iter and bool((res < tol).all()):
            break
    return fs[-1].view_as(y0), iters


@pytest.mark.parametrize("min_iter", [0, 8])
@pytest.mark.parametrize("check_every", [1, 3])
def test_attractor_variant_matches_the_reference(min_iter, check_every):
    f, x, _ = tanh_map()
    with torch.no_grad():
        want, want_iters = reference_attractor_solve(f, x.detach(), 60, 1e-6, min_iter=min_iter)
        cfg = SolverConfig(max_iter=60, tol=1e-6, min_iter=min_iter, check_every=check_every, **ATTRACTOR)
        z, stats = solve(f, x.detach(), cfg, training=False)
    if check_every == 1:
        assert stats.iterations == want_iters and stats.stopped_by == "converged"
        assert torch.allclose(z, want, rtol=0, atol=1e-7), (z - want).abs().max()
    else:      # reads every 3rd iteration: the first read at or after the eager stop
        assert stats.iterations == -(-want_iters // 3) * 3
        with torch.no_grad():     # ... and the iterate the reference reaches after that many steps
            ref, _ = reference_attractor_solve(f, x.detach(), stats.iterations, 0.0)
        assert torch.allclose(z, ref, rtol=0, atol=1e-7), (z - ref).abs().max()
    assert want_iters > 3


def test_sample_l2_is_the_whole_sample_residual_against_the_previous_iterate():
    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])
    got = sample_residual(new, old, real)
    for b in range(2):
        keep = real[b]
        want = (new[b, keep] - old[b, keep]).norm() / old[b, keep].norm()
        assert torch.allclose(got[b], want, rtol=1e-6)


@pytest.mark.parametrize("check_every", [1, 3])
def test_min_iter_holds_the_stop_and_every_sample_must_pass(check_every):
    x = torch.randn(3, 4, 8, dtype=torch.float64)

    def constant(z):                      # converged (residual 0) from the second application on
        return x + 0 * z
    base = dict(norm="sample_l2", decisions="sample", stop_quantile=0.0, patience=0, tol=1e-6, max_iter=20,
                check_every=check_every)
    with torch.no_grad():
        _, free = solve(constant, torch.zeros_like(x), SolverConfig(**base), training=False)
        _, held = solve(constant, torch.zeros_like(x), SolverConfig(**base, min_iter=7), training=False)
    assert free.iterations == (2 if check_every == 1 else 3)
    assert held.iterations == (7 if check_every == 1 else 9)
    (f1, x1, _), (f2, x2, _) = tanh_map((0.2,), seed=1), tanh_map((0.9,), seed=2)

    def both_f(z):                        # p = 0: the batch runs until its slowest sample passes
        return torch.cat([f1(z[:1]), f2(z[1:])])
    cfg = SolverConfig(**{**base, "check_every": 1, "max_iter": 200})
    with torch.no_grad():
        _, both = solve(both_f, torch.cat([x1, x2]).detach(), cfg, training=False)
        alone = [solve(fb, xb.detach(), cfg, training=False)[1].iterations for fb, xb in ((f1, x1), (f2, x2))]
    assert both.iterations == max(alone) and alone[0] < alone[1]


def dense_adjoint(f, z_star, x, g, terms):
    """dL/dx through z* for L = <g, z*>: u = sum_{i<terms} (J^T)^i g (terms None: (I - J^T)^-1 g),
    then (df/dx)^T u, with the dense Jacobians of f at z*."""
    n = z_star.numel()
    J = torch.autograd.functional.jacobian(lambda z: f(z.view_as(z_star)).reshape(-1), z_star.reshape(-1))
    Jx = torch.autograd.functional.jacobian(lambda xx: f_with_x(f, z_star, xx).reshape(-1), x.detach())
    gv = g.reshape(-1)
    if terms is None:
        u = torch.linalg.solve(torch.eye(n, dtype=J.dtype) - J.T, gv)
    else:
        u, term = gv.clone(), gv.clone()
        for _ in range(terms - 1):
            term = J.T @ term
            u = u + term
    return (Jx.reshape(n, -1).T @ u).view_as(x)


def f_with_x(f, z, xx):
    return torch.tanh(z @ f.W + xx)


def test_neumann1_and_the_anderson_adjoint_against_dense_jacobians():
    f, x, W = tanh_map()
    f.W = W
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = {}
    for backward in ("neumann1", "implicit"):
        cfg = SolverConfig(max_iter=80, tol=1e-7, min_iter=4, backward=backward, backward_tol=1e-7,
                           backward_max_iter=80, backward_min_iter=5, **ATTRACTOR)
        z, stats = solve(f, x.detach(), cfg, training=True)
        (grad,) = torch.autograd.grad((z * g).sum(), x)
        grads[backward] = (grad, z.detach(), stats)
    grad, z_star, stats = grads["neumann1"]
    assert stats.backward_iterations == 1
    assert torch.allclose(grad, dense_adjoint(f, z_star, x, g, terms=2), rtol=1e-10, atol=1e-12)
    grad, z_star, stats = grads["implicit"]
    exact = dense_adjoint(f, z_star, x, g, terms=None)
    assert stats.backward_iterations >= 5
    assert (grad - exact).norm() / exact.norm() < 1e-5


def test_fused_bookkeeping_with_sample_l2_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="bookkeeping"):
        SolverConfig(norm="sample_l2", decisions="sample", bookkeeping="fused").validate("solver")
    with pytest.raises(ConfigError, match="decisions"):
        SolverConfig(norm="sample_l2", decisions="token").validate("solver")
    with pytest.raises(ConfigError, match="anderson_variant"):
        SolverConfig(anderson_variant="attractor", decisions="sample").validate("solver")


@pytest.mark.parametrize("check_every", [1, 4])
def test_attractor_solve_reads_the_host_once_per_read_iteration(check_every):
    """Their loop reads rel.max(), the solve's info flag and two finiteness checks per iteration
    (solvers.py:79, 88, 98, 109); fpscale's variant of it reads the stop decision once per iteration,
    or once every ``check_every`` (and at the cap)."""
    from fpscale.profiling import count_host_reads
    f, x, _ = tanh_map()
    cfg = SolverConfig(max_iter=60, tol=1e-6, min_iter=4, check_every=check_every, **ATTRACTOR)
    with torch.no_grad(), count_host_reads() as reads:
        _, stats = solve(f, x.detach(), cfg, training=False)
    assert stats.stopped_by == "converged" and stats.iterations > 8
    assert reads.total == -(-stats.iterations // check_every)
