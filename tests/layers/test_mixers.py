"""FP-Mamba's channel mixers keep what they claim: ||I - Q_t||_2 < 1 (Theorem 3.1 of seed 002)
on thousands of random tokens and parameter draws, and eigenvalues of Q_t below 0 exactly
where ``negative_eigs`` asks for them (seed 002's doubling of the coefficients)."""
import math

import pytest
import torch

from fpscale.layers.mixers import A_LOGIT_MAX, apply_mixer, coefficient_scale, make_mixer_params

MIXERS = ["householder", "dplr", "kronecker"]
DI = 12                      # d_inner: kronecker factors it as 3 x 4


def dense_q(kind, params, x, y, negative_eigs):
    """Q_t as a matrix per token: [N, DI, DI], applied to the identity's columns (float64)."""
    eye = torch.eye(DI, dtype=torch.float64)
    cols = [apply_mixer(kind, params, eye[j].expand_as(x), x, y, negative_eigs) for j in range(DI)]
    return torch.stack(cols, -1)[0]


def draws(kind, rank, negative_eigs, n_params=40, tokens=100, seed=0):
    """Q of ``tokens`` random tokens under each of ``n_params`` random parameter draws. Parameter
    scales vary over draws (std 0.1 .. 3), so the coefficients a_i cover their whole range,
    saturated sigmoids included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_params):
        std = 0.1 * 30 ** (i / (n_params - 1))
        torch.manual_seed(1000 * seed + i)
        params = {k: torch.nn.Parameter(v.double()) for k, v in make_mixer_params(kind, DI, rank, True, std).items()}
        params["mix_a_b"].data.uniform_(-4, 4, generator=g)
        x = torch.randn(1, tokens, DI, generator=g, dtype=torch.float64)
        y = torch.randn(1, tokens, DI, generator=g, dtype=torch.float64)
        with torch.no_grad():
            out.append(dense_q(kind, params, x, y, negative_eigs))
    return torch.cat(out)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("kind", MIXERS)
def test_I_minus_Q_is_a_contraction(kind, rank):
    if kind == "kronecker" and rank > 1:
        pytest.skip("the Kronecker mixer has no rank")
    Q = draws(kind, rank, negative_eigs=False, seed=rank)
    norms = torch.linalg.matrix_norm(torch.eye(DI, dtype=torch.float64) - Q, 2)
    assert Q.shape[0] == 4000
    assert float(norms.max()) < 1.0, float(norms.max())
    if rank == 1:      # ||I - Q|| = a exactly: the draws reach the saturated end of a's range
        assert float(norms.max()) > 0.99
    eig = torch.linalg.eigvals(Q)
    assert float(eig.real.min()) >= -1e-12  # and Q keeps non-negative eigenvalues


def test_the_seeds_householder_range_breaks_the_bound_for_two_reflections():
    """Why a_i < 1/r: two reflections 45 degrees apart with a = 0.99 each (the seed's a_i < 1)."""
    u1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    u2 = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    Q = (torch.eye(2, dtype=torch.float64) - 0.99 * torch.outer(u1, u1)) @ \
        (torch.eye(2, dtype=torch.float64) - 0.99 * torch.outer(u2, u2))
    assert float(torch.linalg.matrix_norm(torch.eye(2, dtype=torch.float64) - Q, 2)) == pytest.approx(1.138, abs=1e-3)
    assert coefficient_scale("householder", 2, False) * 2 <= 1.0


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("kind", MIXERS)
def test_negative_eigs_asks_for_negative_eigenvalues_and_gets_them(kind, rank):
    if kind == "kronecker" and rank > 1:
        pytest.skip("the Kronecker mixer has no rank")
    Q = draws(kind, rank, negative_eigs=True, n_params=20, seed=10 + rank)
    lowest = torch.linalg.eigvals(Q).real.amin(-1)
    assert float((lowest < -0.05).double().mean()) > 0.05      # present in many tokens
    # never below -1 where each factor lies within (-1, 1]; DPLR's doubled terms (2 a_i each, as the
    # authors' models/mixer.py line 85) reach down to 1 - 2r
    floor = 1.0 - 2 * rank if kind == "dplr" else -1.0
    assert float(lowest.min()) > floor - 1e-9


def test_a_saturated_coefficient_stays_inside_its_range():
    """A logit far beyond A_LOGIT_MAX (a float32 sigmoid would round to 1.0) keeps a_i < 1."""
    params = make_mixer_params("householder", DI, 1, False, 0.0)
    params["mix_a_b"].data.fill_(1e4)
    x = torch.randn(1, 3, DI)
    eye = torch.eye(DI)
    Q = torch.stack([apply_mixer("householder", params, eye[j].expand_as(x), x, None) for j in range(DI)], -1)[0]
    norms = torch.linalg.matrix_norm(torch.eye(DI) - Q.detach(), 2)
    assert float(norms.max()) < 1.0 and float(torch.sigmoid(torch.tensor(A_LOGIT_MAX))) < 1.0
