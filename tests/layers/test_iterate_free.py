"""A layer whose f never reads its iterate applies f once (fpscale.solvers.solve.apply_once).

The 125m_mamba baseline (configs/125m_mamba.yaml: fpmamba with ``mixer: none``, ``y_feedback:
false``, ``max_iter: 1``, ``backward: jfb``) ran its mixer twice per forward: a no-grad iteration
f(0), then the jfb step f(f(0)), which is f(0) again. Here: one application, the differentiable
one, the same loss and gradients as the iterating path, 1 iteration in the statistics, one
application in the executed FLOPs; evaluation depth and cached decoding still work."""
import os

import pytest
import torch

import fpscale
from fpscale.models import layer_spec
from fpscale.ops import kernels
from fpscale.solvers import SolverConfig, solve
from fpscale.train.flops import layer_flops, training_flops
from tests.parallel.launch import ROOT

TINY = ["model.d_model=32", "model.n_heads=4", "model.vocab_size=64", "model.max_seq_len=64", "data.seq_len=32",
        "model.layers.0.repeat=2", "train.precision=fp32"]


def baseline(seed: int = 0):
    """configs/125m_mamba.yaml at tiny width: its layer spec and solver section unchanged."""
    cfg = fpscale.load_config(os.path.join(ROOT, "configs", "125m_mamba.yaml"), TINY)
    spec = cfg.model.layers[0]
    assert (spec.type, spec.mixer, spec.y_feedback, spec.solver["forward"]["max_iter"], cfg.solver.backward) == \
        ("fpmamba", "none", False, 1, "jfb")
    torch.manual_seed(seed)
    return cfg, fpscale.build_model(cfg)


def mixers(model):
    return list(model.fixed_point_layers().values())


def force_iterating(model, on: bool = True) -> None:
    """The path every layer took before: the solver's no-grad iterations, then the jfb step."""
    for m in mixers(model):
        m.iterate_free = not on


def tokens(n: int = 4, t: int = 33) -> torch.Tensor:
    return torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(0))


def applications(run) -> int:
    """Applications of the mixer's f during ``run()``: each runs the selective scan once."""
    kernels.reset()
    run()
    return sum(kernels.used().get("scan", {}).values())


def train_step(model, batch):
    model.train()
    model.zero_grad()
    loss = model(batch[:, :-1], targets=batch[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_condition_is_declared_by_the_spec():
    assert layer_spec("fpmamba", mixer="none", y_feedback=False).iterate_free
    for fields in ({"mixer": "none"}, {"mixer": "householder", "y_feedback": False}, {}):
        assert not layer_spec("fpmamba", **fields).iterate_free          # f reads y: it iterates
    _, model = baseline()
    assert all(m.iterate_free and m.backward_mode == "once" for m in mixers(model))


def test_f_does_not_read_its_iterate():
    _, model = baseline()
    m = mixers(model)[0]
    x = torch.randn(2, 8, 32)
    xc, g = torch.nn.functional.linear(x, m.w_in).chunk(2, dim=-1)
    u, gate = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.nn.functional.pad(xc, (0, 0, 3, 0)).transpose(1, 2), m.conv_w, m.conv_b, groups=xc.shape[-1])
        .transpose(1, 2)), torch.nn.functional.silu(g)
    y0 = torch.zeros_like(u)
    assert torch.equal(m.step(y0, u, gate), m.step(torch.randn_like(u), u, gate))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_one_application_per_forward(training):
    _, model = baseline()
    batch = tokens()
    model.train(training)

    def run():
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        if training:
            loss.backward()

    with torch.set_grad_enabled(training):
        assert applications(run) == 2                   # 2 layers, once each, backward included
        stats = model.solver_stats()
        assert [s.iterations for s in stats.values()] == [1, 1]
        assert all(s.stopped_by == "converged" and s.to_dict()["residual_max"] == 0.0 for s in stats.values())
        force_iterating(model)
        # before: a no-grad pass, then the jfb step (issue 36: in evaluation too, the trained function)
        assert applications(run) == 4


def test_same_loss_and_gradients_as_the_iterating_path():
    _, model = baseline()
    batch = tokens()
    loss, grads = train_step(model, batch)
    force_iterating(model)
    old_loss, old_grads = train_step(model, batch)
    assert torch.equal(loss, old_loss)
    assert all(torch.equal(grads[n], old_grads[n]) for n in grads)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "mixer" in n and n.split(".")[-1] != "D")


def test_same_logits_under_bf16_autocast():
    _, model = baseline()
    model.eval()
    batch = tokens()[:, :-1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        once = model(batch)
        force_iterating(model)
        assert torch.equal(once, model(batch))


def test_evaluation_depth_and_cached_decoding():
    _, model = baseline()
    model.eval()
    batch = tokens(2, 12)
    with torch.no_grad():
        ref = model(batch)
        with model.eval_depth(16):
            assert applications(lambda: torch.equal(model(batch), ref) or pytest.fail("depth 16 differs")) == 2
            assert all(s.iterations == 1 and s.max_iter == 16 for s in model.solver_stats().values())
            force_iterating(model)           # before: a second pass to find the residual was 0, then
            assert applications(lambda: model(batch)) == 6      # the jfb step (issue 36: in evaluation too)
            force_iterating(model, False)
    cached = fpscale.generate(model, batch[:, :6], 6, use_cache=True, return_logits=True)
    plain = fpscale.generate(model, batch[:, :6], 6, use_cache=False, return_logits=True)
    assert torch.equal(cached[0], plain[0])
    torch.testing.assert_close(cached[1], plain[1], rtol=1e-4, atol=1e-4)


def test_executed_flops_count_one_application():
    cfg, model = baseline()
    (static, per_iter), _ = layer_flops(cfg.model, 32)
    modes = [m.backward_mode for m in mixers(model)]
    nominal, executed = training_flops(cfg.model, 32, [{"iterations": 1}] * 2, modes, [1, 1])
    assert executed == pytest.approx(nominal)           # forward and backward of one application
    _, before = training_flops(cfg.model, 32, [{"iterations": 1}] * 2, ["jfb"] * 2, [1, 1])
    assert before - executed == pytest.approx(2 * per_iter)


@pytest.mark.parametrize("backward", ["jfb", "phantom", "implicit", "unroll"])
def test_solve_applies_an_iterate_free_map_once_in_every_backward_mode(backward):
    """The solver's mechanism on its own: f(z) = tanh(x W), whatever z; one call, the gradient of
    that call, the value the iterating solve reaches."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 4, generator=g), torch.randn(4, 4, generator=g).requires_grad_()
    calls = []

    def f(z):
        calls.append(torch.is_grad_enabled())
        return torch.tanh(x @ w) + 0 * z          # z reaches the graph (the implicit adjoint), not the value

    cfg = SolverConfig(max_iter=5, backward=backward, tol=1e-3)
    z, stats = solve(f, torch.zeros_like(x), cfg, training=True, iterate_free=True)
    assert calls == [True] and stats.iterations == 1 and stats.stopped_by == "converged"
    (grad,) = torch.autograd.grad(z.sum(), w)
    calls.clear()
    z_old, _ = solve(f, torch.zeros_like(x), cfg, training=True)
    assert len(calls) > 1 and torch.equal(z, z_old)
    torch.testing.assert_close(grad, torch.autograd.grad(z_old.sum(), w)[0])
    calls.clear()
    with torch.no_grad():
        z_eval, stats = solve(f, torch.zeros_like(x), cfg, training=False, iterate_free=True, max_iter=64)
    assert calls == [False] and torch.equal(z_eval, z) and (stats.iterations, stats.max_iter) == (1, 64)
