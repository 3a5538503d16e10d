"""The selective update in the adjoint solve (``solver.backward_freeze``; seed 000, App. C.3)."""
import torch

from fpscale.solvers import SolverConfig, solve
from tests.solvers.test_gradients import _problem, exact_gradients, f_map, rel_err


def test_dense_jacobian_gradient_with_freezing_in_forward_and_adjoint():
    """Freezing on in both solves (tokens converge at different rates: the causal mixing makes token
    0 depend on itself alone), the gradient still is the dense implicit-function-theorem one."""
    W, A, U, x, c = _problem(seed=2)
    gW, gx = exact_gradients(W, A, U, x, c)
    cfg = SolverConfig(max_iter=300, tol=1e-11, backward="implicit", backward_max_iter=300, backward_tol=1e-11,
                       eta_min=0.0, freeze_converged=True, backward_freeze=True, stop_quantile=0.0)
    W_, x_ = W.clone().requires_grad_(), x.clone().requires_grad_()
    z, stats = solve(lambda zz: f_map(zz, W_, A, U, x_), torch.zeros_like(x), cfg, training=False)
    (c * z).sum().backward()
    assert stats.stopped_by == "converged" and stats.backward_iterations > 5
    assert rel_err(W_.grad, gW) < 1e-8 and rel_err(x_.grad, gx) < 1e-8


def _adjoint_iterates(backward_freeze: bool) -> list[torch.Tensor]:
    """Every adjoint iterate u of a map whose tokens are independent: token 0 contracts fast
    (Lipschitz ~0.05), token 1 slowly (~0.9). A hook on an intermediate of f sees each vector-
    Jacobian product's u."""
    g = torch.Generator().manual_seed(0)
    d = 6
    W = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    rate = torch.tensor([0.05, 0.9], dtype=torch.float64).view(1, 2, 1)
    x = torch.randn(1, 2, d, generator=g, dtype=torch.float64, requires_grad=True)
    seen = []

    def f(z):
        y = torch.tanh(rate * (z @ W) + x)
        if y.requires_grad:
            y.register_hook(lambda grad: seen.append(grad.detach().clone()))
        return y * 1.0

    cfg = SolverConfig(max_iter=200, tol=1e-12, backward_max_iter=200, backward_tol=1e-10, eta_min=0.0,
                       stop_quantile=0.0, freeze_converged=True, backward_freeze=backward_freeze)
    z, _ = solve(f, torch.zeros_like(x), cfg, training=False)
    z.sum().backward()
    return seen[:-1]          # the last one is the outer backward's pass through f with the final u


def test_adjoint_freezes_converged_entries():
    frozen, free = _adjoint_iterates(True), _adjoint_iterates(False)
    assert len(frozen) > 20

    def last_change(us, token):
        return max(i for i in range(1, len(us)) if not torch.equal(us[i][0, token], us[i - 1][0, token]))

    # with the selective update token 0's adjoint stops changing early while token 1 still iterates
    assert last_change(frozen, 0) < 12 < last_change(frozen, 1)
    # without it, token 0's adjoint is recomputed (and moves in its last bits) as long as the solve runs
    assert last_change(free, 0) > last_change(frozen, 0)
