"""Stop rules, damping with patience, Anderson, freezing, safeguards, consensus, bad input."""
import math

import pytest
import torch

from fpscale.errors import ConfigError
from fpscale.solvers import SolverConfig, solve
from fpscale.solvers.iterate import StopFlags
from fpscale.typed import from_dict

TOL = 1e-3


def affine(c):
    """Sample b contracts to 1 with factor c[b]: z <- c z + (1 - c)."""
    c = c.view(-1, 1, 1)
    return lambda z: c * z + (1 - c)


def first_converged_iteration(c: float, tol: float) -> int:
    """Independent scalar replay of the solver's residual for one sample."""
    z = 0.0
    for k in range(1, 10_000):
        new = c * z + (1 - c)
        if abs(new - z) / (abs(new) + 1e-6) < tol:
            return k
        z = new
    raise AssertionError


@pytest.mark.parametrize("p,allowed", [(0.0, 0), (0.1, 0), (0.125, 1), (0.25, 2), (0.3, 2), (0.5, 4), (0.75, 6)])
def test_quantile_rule_stops_once_at_most_pB_are_unconverged(p, allowed):
    """At least (1 - p) of the samples converged: at most floor(p * B) unconverged (seed 002, B.4)."""
    c = torch.tensor([0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9], dtype=torch.float64)
    B = len(c)
    conv_at = sorted(first_converged_iteration(float(ci), TOL) for ci in c)
    expected = conv_at[B - 1 - allowed]          # the (B - allowed)-th sample to converge
    cfg = SolverConfig(max_iter=500, tol=TOL, stop_quantile=p, patience=0)
    _, stats = solve(affine(c), torch.zeros(B, 2, 3, dtype=torch.float64), cfg, training=True)
    assert stats.iterations == expected
    assert stats.stopped_by == ("converged" if allowed == 0 else "quantile")
    assert int((stats.sample_residual >= TOL).sum()) == allowed


def stuck_batch(B=8, stuck=(2, 5)):
    """Samples converge at different rates, except ``stuck`` ones, which flip sign forever."""
    c = torch.linspace(0.1, 0.6, B, dtype=torch.float64).view(-1, 1, 1)
    flip = torch.zeros(B, 1, 1, dtype=torch.bool)
    flip[list(stuck)] = True
    return lambda z: torch.where(flip, -z + 0.5 * (z == 0), c * z + (1 - c))


def test_two_samples_that_cannot_converge_stop_by_quantile_at_p_quarter():
    cfg = SolverConfig(max_iter=60, tol=TOL, stop_quantile=0.25, patience=0)
    z0 = torch.zeros(8, 3, 2, dtype=torch.float64)
    _, stats = solve(stuck_batch(), z0, cfg, training=True)
    assert stats.stopped_by == "quantile" and stats.iterations < 60
    assert torch.equal(stats.sample_residual >= TOL, torch.tensor([0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool))
    _, strict = solve(stuck_batch(), z0, SolverConfig(**{**cfg.__dict__, "stop_quantile": 0.0}), training=True)
    assert strict.stopped_by == "max_iter" and strict.iterations == 60
    _, three = solve(stuck_batch(stuck=(1, 4, 6)), z0, cfg, training=True)     # 3 > floor(0.25 * 8)
    assert three.stopped_by == "max_iter"


def test_per_sample_damping_leaves_a_contracting_sample_alone():
    """A contracting sample next to an oscillating one takes the iterations it takes alone:
    the oscillating sample's stagnation decays its own eta, not its neighbour's."""
    f_rot, z_star = rotation_map()
    c = 0.8

    def pair(z):                                # sample 0 contracts, sample 1 rotates outward
        return torch.stack([c * z[0] + (1 - c), f_rot(z[1])])

    cfg = SolverConfig(max_iter=400, tol=TOL, stop_quantile=0.5, damping=1.0, patience=2, decay=0.5, eta_min=1e-4)
    z0 = torch.zeros(2, 1, 2, dtype=torch.float64)
    z, both = solve(pair, z0, cfg, training=True)          # p = 0.5: stops once sample 0 converged
    alone = solve(lambda z: c * z + (1 - c), z0[:1], cfg, training=False)[1]
    assert both.stopped_by == "quantile" and both.iterations == alone.iterations == first_converged_iteration(c, TOL)
    assert float(both.final_eta[0]) == 1.0 and float(both.final_eta[1]) < 1.0
    # evaluation waits for both; the rotating sample converges with the damping it found for itself
    z, evaluation = solve(pair, z0, cfg, training=False)
    assert evaluation.stopped_by == "converged"
    assert torch.allclose(z[1, 0], z_star, atol=1e-2)


def test_evaluation_ignores_stop_quantile():
    c = torch.tensor([0.1, 0.9], dtype=torch.float64)
    cfg = SolverConfig(max_iter=500, tol=TOL, stop_quantile=0.75, patience=0)
    _, train = solve(affine(c), torch.zeros(2, 1, 1, dtype=torch.float64), cfg, training=True)
    _, evaluation = solve(affine(c), torch.zeros(2, 1, 1, dtype=torch.float64), cfg, training=False)
    assert train.iterations == first_converged_iteration(0.1, TOL)
    assert evaluation.iterations == first_converged_iteration(0.9, TOL)
    assert evaluation.to_dict()["converged_fraction"] == 1.0


def test_cap_stops_it():
    c = torch.tensor([0.9], dtype=torch.float64)
    z, stats = solve(affine(c), torch.zeros(1, 1, 1, dtype=torch.float64),
                     SolverConfig(max_iter=7, tol=0.0), training=False)
    assert stats.iterations == 7 and stats.stopped_by == "max_iter"
    assert float(z.detach()) == pytest.approx(1 - 0.9 ** 7)


def test_eta_min_stops_it():
    """f(z) = 2z has a scale-free residual of 1/2: it never improves, so eta decays to eta_min."""
    cfg = SolverConfig(max_iter=100, tol=1e-6, damping=1.0, patience=2, decay=0.5, eta_min=0.1)
    _, stats = solve(lambda z: 2 * z, torch.ones(1, 1, 2), cfg, training=False)
    # eta: 1 (k=1, first residual is progress) -> 0.5 (k=3) -> 0.25 (k=5) -> 0.125 (k=7) -> 0.0625 (k=9)
    assert stats.stopped_by == "eta_min" and stats.iterations == 9
    assert float(stats.final_eta) == pytest.approx(0.0625)


def rotation_map(scale=1.05, angle=math.pi / 2):
    """Linear map with eigenvalues scale*e^{+-i angle}: |lambda| >= 1, Re(lambda) < 1."""
    R = scale * torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]],
                             dtype=torch.float64)
    b = torch.tensor([1.0, -0.5], dtype=torch.float64)
    z_star = torch.linalg.solve(torch.eye(2, dtype=torch.float64) - R, b)
    return (lambda z: z @ R.T + b), z_star


def test_undamped_iteration_of_an_oscillating_map_fails():
    f, _ = rotation_map()
    _, stats = solve(f, torch.zeros(1, 1, 2, dtype=torch.float64),
                     SolverConfig(max_iter=200, tol=1e-8, patience=0), training=False)
    assert stats.stopped_by == "max_iter"


@pytest.mark.parametrize("damping,patience", [(0.5, 0), (1.0, 3)])
def test_damping_rescues_an_oscillating_map(damping, patience):
    f, z_star = rotation_map()
    z, stats = solve(f, torch.zeros(1, 1, 2, dtype=torch.float64),
                     SolverConfig(max_iter=400, tol=1e-8, damping=damping, patience=patience, decay=0.7,
                                  eta_min=1e-3), training=False)
    assert stats.stopped_by == "converged"
    assert torch.allclose(z[0, 0], z_star, atol=1e-6)
    if patience:
        assert float(stats.final_eta) < 1.0      # the patience rule found the damping itself


def test_anderson_converges_faster_to_the_same_point():
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    M = Q @ torch.diag(torch.linspace(-0.98, 0.98, 16, dtype=torch.float64)) @ Q.T   # slow contraction
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    def f(z):
        return z @ M + x

    cfg = SolverConfig(max_iter=2000, tol=1e-10, patience=0)
    z_plain, s_plain = solve(f, torch.zeros_like(x), cfg, training=False)
    z_and, s_and = solve(f, torch.zeros_like(x), SolverConfig(**{**cfg.__dict__, "anderson": 5}), training=False)
    assert s_plain.stopped_by == s_and.stopped_by == "converged"
    assert s_and.iterations < s_plain.iterations / 3
    assert torch.allclose(z_plain, z_and, atol=1e-8)


def test_freezing_keeps_frozen_tokens_bit_identical():
    rates = torch.tensor([0.1, 0.5, 0.8, 0.95], dtype=torch.float64).view(1, 4, 1)

    def g(z):                                   # tokens converge at different rates and interact
        return rates * z + (1 - rates) + 1e-3 * z.mean(1, keepdim=True)

    iterates = []                               # iterates[k] is the input of the (k+1)-th step: z_k

    def f(z):
        iterates.append(z.clone())
        return g(z)

    with torch.no_grad():   # no implicit-backward application of f: only the iterations are recorded
        z, stats = solve(f, torch.zeros(1, 4, 3, dtype=torch.float64),
                         SolverConfig(max_iter=500, tol=1e-4, freeze_converged=True, patience=0))
    assert stats.stopped_by == "converged" and len(iterates) == stats.iterations
    states = iterates + [z]                     # z_0 .. z_K, the last one returned
    for t in range(4):
        res = [float((g(zk)[0, t] - zk[0, t]).abs().max() / g(zk)[0, t].abs().max()) for zk in iterates]
        k = next(i for i, r in enumerate(res) if r < 1e-4)   # the step at which token t converged
        for later in states[k + 1:]:                         # frozen from z_{k+1} on
            assert torch.equal(later[0, t], states[k + 1][0, t])
    # per token (the default ``decisions``) a converged token retires the same way
    iterates.clear()
    with torch.no_grad():
        z_token, _ = solve(f, torch.zeros(1, 4, 3, dtype=torch.float64), SolverConfig(max_iter=500, tol=1e-4,
                                                                                   patience=0))
    assert torch.equal(z_token, z)
    # without freezing (per sample, freeze_converged off), the fast token keeps moving (the assertion above can fail)
    iterates.clear()
    with torch.no_grad():
        solve(f, torch.zeros(1, 4, 3, dtype=torch.float64), SolverConfig(max_iter=500, tol=1e-4, patience=0,
                                                                         decisions="sample"))
    assert not torch.equal(iterates[-1][0, 0], iterates[-2][0, 0])


def test_nonfinite_residual_stops_and_keeps_last_finite_iterate():
    calls = []

    def f(z):
        calls.append(1)
        return z * 0.5 + 1 if len(calls) < 4 else z * float("inf")

    z, stats = solve(f, torch.zeros(2, 3, 1), SolverConfig(max_iter=50, tol=1e-6), training=False)
    assert stats.stopped_by == "nonfinite" and stats.nonfinite and stats.iterations == 4
    assert torch.isfinite(z).all()
    assert torch.allclose(z, torch.full_like(z, 1.75))       # z_3 = 0 -> 1 -> 1.5 -> 1.75


def test_deterministic():
    torch.manual_seed(0)
    W = 0.5 * torch.randn(8, 8) / 8 ** 0.5
    x = torch.randn(4, 5, 8)
    cfg = SolverConfig(max_iter=40, tol=1e-5, anderson=3, damping=0.9)
    runs = [solve(lambda z: torch.tanh(z @ W + x), torch.zeros_like(x), cfg, training=False) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].iterations == runs[1][1].iterations


def test_stop_flags_pack_into_one_tensor_and_back():
    """The consensus protocol's wire format: [nonfinite, unconverged_b (B), no_progress_b (B)]."""
    flags = StopFlags(nonfinite=torch.tensor(True), unconverged=torch.tensor([True, False, True]),
                      no_progress=torch.tensor([False, False, True]))
    packed = flags.pack()
    assert packed.dtype == torch.int64 and packed.tolist() == [1, 1, 0, 1, 0, 0, 1]
    back = StopFlags.unpack(packed, 3)
    assert bool(back.nonfinite) and back.unconverged.tolist() == [True, False, True]
    assert back.no_progress.tolist() == [False, False, True]


def test_consensus_keeps_ranks_iterating_together():
    """A peer whose sample is still unconverged keeps this rank going (TP lock-step): the
    packed StopFlags are MAX-reduced over the group."""
    c = torch.tensor([0.1], dtype=torch.float64)
    alone = solve(affine(c), torch.zeros(1, 1, 1, dtype=torch.float64), SolverConfig(tol=TOL), training=False)[1]
    peer_iterations = alone.iterations + 5
    seen = []

    def consensus(flags):           # element-wise MAX with a simulated peer's flags
        seen.append(flags.clone())
        peer = StopFlags(nonfinite=torch.tensor(False), unconverged=torch.tensor([len(seen) < peer_iterations]),
                         no_progress=torch.tensor([False]))
        return torch.maximum(flags, peer.pack())

    _, stats = solve(affine(c), torch.zeros(1, 1, 1, dtype=torch.float64), SolverConfig(tol=TOL),
                     training=False, consensus=consensus)
    assert stats.iterations == peer_iterations == len(seen)


def test_consensus_makes_damping_agree():
    """A peer that saw no progress on a sample makes this rank decay that sample's eta too, so
    every TP rank applies the same damping (the agreed flags decide, not the local residual)."""
    c = torch.tensor([0.5, 0.5], dtype=torch.float64)
    cfg = SolverConfig(max_iter=6, tol=0.0, patience=1, decay=0.5, eta_min=1e-3)

    def consensus(flags):           # the peer never sees progress on sample 1
        peer = StopFlags(nonfinite=torch.tensor(False), unconverged=torch.tensor([False, False]),
                         no_progress=torch.tensor([False, True]))
        return torch.maximum(flags, peer.pack())

    _, stats = solve(affine(c), torch.zeros(2, 1, 1, dtype=torch.float64), cfg, training=False, consensus=consensus)
    assert stats.iterations == 6
    assert float(stats.final_eta[0]) == 1.0 and float(stats.final_eta[1]) == 0.5 ** 6


def test_nonfinite_start_is_reported_not_raised():
    """An upstream NaN stops the solve at once (and reaches the loss: the step is skipped)."""
    z0 = torch.tensor([[1.0, float("nan")]])
    z, stats = solve(lambda z: z * 0.5, z0, SolverConfig(max_iter=10))
    assert stats.stopped_by == "nonfinite" and stats.iterations == 1
    assert torch.equal(z.isnan(), z0.isnan())


def test_bad_inputs_raise_clear_errors():
    def f(z):
        return z * 0.5

    with pytest.raises(ValueError, match=r"shaped like z \(2, 3\), got \(2, 4\)"):
        solve(lambda z: torch.zeros(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[batch, tokens"):
        solve(f, torch.zeros(3))


@pytest.mark.parametrize("key,value,needle", [
    ("max_iter", 0, "max_iter': must be >= 1"),
    ("damping", 1.5, "damping': must lie in (0, 1]"),
    ("stop_quantile", 1.0, "stop_quantile': must lie in [0, 1)"),
    ("anderson", 1, "anderson': is the Anderson window"),
    ("backward", "adjoint", "backward': must be one of 'implicit'"),
    ("tol", "small", "tol': expected a number"),
    ("max_iter", 2.5, "max_iter': expected an integer"),
    ("freeze", True, "freeze': unknown key for SolverConfig (did you mean 'solver.forward.freeze_converged'?)"),
])
def test_nonsense_solver_config_names_the_key(key, value, needle):
    with pytest.raises(ConfigError) as info:
        from_dict(SolverConfig, {key: value}, "solver")
    assert needle in str(info.value)
def test_padding_never_holds_a_solve_up():
    """Tokens marked not ``real`` (left padding) count as converged in the stop test: a map that
    never settles on them leaves the real tokens' solve, its iterations and its result as they are
    without the padding."""
    def f(z):       # contracts on the last 3 tokens, flips sign forever on the first 2
        flip = torch.zeros_like(z, dtype=torch.bool)
        flip[:, :2] = True
        return torch.where(flip, 3.0 - z, 0.5 * z + 1.0)

    cfg = SolverConfig(tol=1e-6, max_iter=200, damping=1.0, patience=0)
    z0 = torch.zeros(2, 5, 4)
    real = torch.ones(2, 5, dtype=torch.bool)
    real[:, :2] = False
    with torch.no_grad():
        z, stats = solve(f, z0, cfg, training=False, real=real)
        alone, alone_stats = solve(lambda z: 0.5 * z + 1.0, z0[:, 2:], cfg, training=False)
        _, unmasked = solve(f, z0, cfg, training=False)
    assert stats.stopped_by == "converged" and stats.iterations == alone_stats.iterations
    assert torch.equal(z[:, 2:], alone)
    assert unmasked.stopped_by == "max_iter"       # without the mask the padding holds it up
