"""MuonAdamW on one process: Newton-Schulz against the SVD, the update against muon.py's formula, the AdamW
groups against torch's AdamW, and its state across a save.

The quintic is not exact (muon.py's docstring: it "does not produce UV^T but rather something like
US'V^T"): what is exact, in float64, is that it is a polynomial of the singular values, O = U p(S/|G|_F) V^T
with p the scalar iteration, to 1e-12. The documented tolerance: every singular direction with
sigma_i >= 1e-2 sigma_1 lands in [0.68, 1.2] after 5 steps (directions below that are only partly
lifted: 3.4445^5 ~ 485 is the most 5 steps can raise a value near zero)."""
import pytest
import torch

from fpscale.train.muon import POLAR_EXPRESS, QUINTIC, MuonAdamW, newton_schulz, shape_scale

BAND = (0.68, 1.2)


def scalar_iteration(s: torch.Tensor, coefficients: str) -> torch.Tensor:
    for a, b, c in ([QUINTIC] * 5 if coefficients == "quintic" else POLAR_EXPRESS):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def ill_conditioned(n: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    return u @ torch.diag(torch.logspace(0, -6, n, dtype=torch.float64)) @ v.T


MATRICES = {"tall": lambda: torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
            "wide": lambda: torch.randn(32, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
            "ill_conditioned": ill_conditioned}


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("kind", list(MATRICES))
def test_newton_schulz_against_the_svd(kind, coefficients):
    g = MATRICES[kind]()
    o = newton_schulz(g, 5, torch.float64, coefficients)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    norm = g.norm() + 1e-7 if coefficients == "quintic" else g.norm() * 1.02 + 1e-6
    predicted = u @ torch.diag(scalar_iteration(s / norm, coefficients)) @ vh
    assert (o - predicted).abs().max() < 1e-12               # U p(S) V^T: G's singular vectors, exactly
    inner = torch.diagonal(u.T @ o @ vh.T)                    # the singular values O gives each direction
    resolved = s >= 1e-2 * s[0]
    lo, hi = (0.85, 1.15) if coefficients == "polar_express" else BAND
    assert inner[resolved].min() >= lo and inner.max() <= hi
    polar = u @ vh                                            # the exact orthogonal factor U V^T
    cosine = (o * polar).sum() / (o.norm() * polar.norm())
    assert cosine > (0.98 if kind != "ill_conditioned" else 0.7)
    if kind == "ill_conditioned":          # directions far below sigma_1 stay below the band
        assert inner[~resolved].min() < BAND[0]


def test_newton_schulz_in_bf16_is_within_a_few_percent_of_float64():
    for make in (MATRICES["tall"], MATRICES["wide"]):
        g = make()
        exact = newton_schulz(g, 5, torch.float64)
        assert ((newton_schulz(g.float(), 5, torch.bfloat16).double() - exact).norm() / exact.norm()) < 0.05


def test_newton_schulz_orthogonalises_each_matrix_of_a_stack():
    g = torch.randn(3, 16, 24, dtype=torch.float64)
    stacked = newton_schulz(g, 5, torch.float64)
    for i in range(3):
        assert torch.allclose(stacked[i], newton_schulz(g[i], 5, torch.float64), atol=1e-13)


def test_shape_scales():
    assert shape_scale((256, 64), "keller") == 2.0 and shape_scale((64, 256), "keller") == 1.0
    assert shape_scale((2, 256, 64), "moonlight") == pytest.approx(0.2 * 16)


def muon_group(params, **kw):
    return {"params": params, "kind": "muon", "lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True,
            "ns_steps": 5, "ns_dtype": "fp64", "ns_coefficients": "quintic", "shape_scale": "keller",
            "cautious": False, **kw}


@pytest.mark.parametrize("cautious", [False, True])
def test_muon_step_is_muon_py_update(cautious):
    """Keller's muon_update + SingleDeviceMuon.step (written out here), cautious decay as Attractor's."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 16, dtype=torch.float64))
    opt = MuonAdamW([muon_group([p], cautious=cautious)])
    w, m = p.detach().clone(), torch.zeros_like(p)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g                                   # momentum.lerp_(grad, 1 - beta)
        u = 0.1 * g + 0.9 * m                                   # grad.lerp_(momentum, beta)
        o = newton_schulz(u, 5, torch.float64) * max(1, 48 / 16) ** 0.5
        mask = (o * w >= 0).double() if cautious else torch.ones_like(w)
        w = w - 0.05 * 0.1 * w * mask - 0.05 * o
        assert torch.allclose(p.detach(), w, atol=1e-13)
    assert torch.allclose(opt.state[p]["exp_avg"], m, atol=1e-14)


def test_adamw_groups_are_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40, 8))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MuonAdamW([{"params": [a], "kind": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95),
                       "eps": 1e-8}])
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-8, foreach=False)
    for _ in range(4):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b)


def test_state_dict_round_trip_continues_exactly_and_carries_exp_avg_sq():
    torch.manual_seed(0)
    grads = [torch.randn(24, 12, dtype=torch.float64) for _ in range(5)]

    def run(split: bool):
        p = torch.nn.Parameter(torch.ones(24, 12, dtype=torch.float64))
        opt = MuonAdamW([muon_group([p], cautious=True)])
        for i, g in enumerate(grads):
            if split and i == 3:
                sd = opt.state_dict()
                assert torch.equal(sd["state"][0]["exp_avg_sq"], torch.zeros(24, 12, dtype=torch.float64))
                opt = MuonAdamW([muon_group([p], cautious=True)])
                opt.load_state_dict(sd)
            p.grad = g.clone()
            opt.step()
        assert "exp_avg_sq" not in opt.state[p]          # a Muon parameter keeps one buffer
        return p.detach()

    assert torch.equal(run(False), run(True))


def test_skip_next_skips_one_step():
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = MuonAdamW([muon_group([p], ns_dtype="fp32")])
    p.grad = torch.randn(8, 8)
    opt.skip_next = True
    opt.step()
    assert torch.equal(p.detach(), torch.ones(8, 8)) and not opt.skip_next
