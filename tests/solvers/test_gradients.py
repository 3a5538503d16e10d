"""Backward modes against the exact implicit-function-theorem gradient (dense Jacobian)."""
import dataclasses

import torch
from torch.func import jacrev

from fpscale.solvers import SolverConfig, solve

B, T, D = 2, 3, 4


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, D, generator=g, dtype=torch.float64)
    W = 0.6 * W / torch.linalg.matrix_norm(W, 2)
    A = torch.tril(torch.rand(T, T, generator=g, dtype=torch.float64))
    A = A / A.sum(-1, keepdim=True)                     # causal token mixing, row-stochastic
    U = torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    c = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    return W, A, U, x, c


def f_map(z, W, A, U, x):
    return torch.tanh(A @ z @ W + x @ U)


def exact_gradients(W, A, U, x, c):
    """dL/dW, dL/dx for L = <c, z*> from (I - J)^{-1} with dense Jacobians."""
    with torch.no_grad():
        z = torch.zeros_like(x)
        for _ in range(500):
            z = f_map(z, W, A, U, x)
    N = z.numel()
    J = jacrev(lambda zz: f_map(zz, W, A, U, x))(z).reshape(N, N)
    dfdW = jacrev(lambda WW: f_map(z, WW, A, U, x))(W).reshape(N, -1)
    dfdx = jacrev(lambda xx: f_map(z, W, A, U, xx))(x).reshape(N, -1)
    eye = torch.eye(N, dtype=torch.float64)
    u = torch.linalg.solve((eye - J).T, c.reshape(N))     # adjoint
    return (u @ dfdW).reshape(W.shape), (u @ dfdx).reshape(x.shape)


def solver_gradients(cfg, W, A, U, x, c):
    W = W.clone().requires_grad_()
    x = x.clone().requires_grad_()
    z, stats = solve(lambda zz: f_map(zz, W, A, U, x), torch.zeros_like(x), cfg, training=False)
    (c * z).sum().backward()
    return W.grad, x.grad, stats


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_implicit_matches_dense_ift():
    W, A, U, x, c = _problem()
    gW, gx = exact_gradients(W, A, U, x, c)
    cfg = SolverConfig(max_iter=300, tol=1e-13, backward="implicit", backward_max_iter=300,
                       backward_tol=1e-13, eta_min=0.0)
    sW, sx, stats = solver_gradients(cfg, W, A, U, x, c)
    assert stats.stopped_by == "converged"
    assert stats.backward_iterations is not None and stats.backward_iterations > 1
    assert rel_err(sW, gW) < 1e-6
    assert rel_err(sx, gx) < 1e-6


def test_implicit_with_anderson_and_damping_matches_dense_ift():
    W, A, U, x, c = _problem(seed=1)
    gW, gx = exact_gradients(W, A, U, x, c)
    cfg = SolverConfig(max_iter=300, tol=1e-13, damping=0.8, anderson=4, backward="implicit",
                       backward_max_iter=300, backward_tol=1e-13, eta_min=0.0)
    sW, sx, _ = solver_gradients(cfg, W, A, U, x, c)
    assert rel_err(sW, gW) < 1e-6 and rel_err(sx, gx) < 1e-6


def test_unroll_converges_to_implicit_gradient():
    W, A, U, x, c = _problem()
    gW, _ = exact_gradients(W, A, U, x, c)
    errors = []
    for n in (2, 8, 60):
        cfg = SolverConfig(max_iter=n, tol=0.0, backward="unroll", patience=0)
        sW, _, stats = solver_gradients(cfg, W, A, U, x, c)
        assert stats.iterations == n
        errors.append(rel_err(sW, gW))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-8


def test_phantom_error_shrinks_with_steps():
    W, A, U, x, c = _problem()
    gW, gx = exact_gradients(W, A, U, x, c)
    errors = []
    for k in (1, 2, 4, 8, 16):
        cfg = SolverConfig(max_iter=300, tol=1e-13, backward="phantom", phantom_steps=k, eta_min=0.0)
        sW, sx, _ = solver_gradients(cfg, W, A, U, x, c)
        errors.append(rel_err(sW, gW) + rel_err(sx, gx))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-3


def test_jfb_is_one_phantom_step():
    W, A, U, x, c = _problem()
    jfb = solver_gradients(SolverConfig(max_iter=300, tol=1e-13, backward="jfb", eta_min=0.0), W, A, U, x, c)
    one = solver_gradients(SolverConfig(max_iter=300, tol=1e-13, backward="phantom", phantom_steps=1,
                                        eta_min=0.0), W, A, U, x, c)
    assert torch.equal(jfb[0], one[0]) and torch.equal(jfb[1], one[1])


def test_implicit_masks_unconverged_tokens():
    """A token that never converges receives no adjoint: its cotangent does not reach x."""
    W, A, U, x, c = _problem()
    x = x.clone().requires_grad_()
    # token 0 of sample 0 oscillates (f flips its sign): it never converges
    sign = torch.ones(B, T, 1, dtype=torch.float64)
    sign[0, 0] = -1

    def f(z):
        out = f_map(z, W, torch.eye(T, dtype=torch.float64), U, x)
        return torch.where(sign > 0, out, -z + 0.0 * out)

    z, stats = solve(f, torch.ones_like(x), SolverConfig(max_iter=50, tol=1e-10, patience=0), training=False)
    assert not bool(stats.token_converged[0, 0]) and bool(stats.token_converged[1:].all())
    c = torch.zeros_like(x)
    c[0, 0] = 1.0                                   # loss reads only the unconverged token
    (c * z).sum().backward()
    assert torch.count_nonzero(x.grad) == 0


def test_implicit_at_a_fixed_depth_keeps_the_gradient():
    """tol 0 (a fixed depth, as Huginn and Parcae train): no token counts as converged, yet the implicit
    backward must not mask them all out (it returned zero gradients): it equals mask_unconverged off."""
    W, A, U, x, c = _problem()
    exact_W, exact_x = exact_gradients(W, A, U, x, c)
    fixed = SolverConfig(max_iter=60, tol=0.0, backward="implicit", backward_max_iter=200, backward_tol=1e-12)
    gW, gx, stats = solver_gradients(fixed, W, A, U, x, c)
    assert stats.iterations == 60
    assert rel_err(gW, exact_W) < 1e-6 and rel_err(gx, exact_x) < 1e-6
    gW_off, gx_off, _ = solver_gradients(dataclasses.replace(fixed, mask_unconverged=False), W, A, U, x, c)
    assert torch.equal(gW, gW_off) and torch.equal(gx, gx_off)
