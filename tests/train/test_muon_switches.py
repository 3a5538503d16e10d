"""Muon's switches for what the peers do (issue 48), each against its formula written out here, one process,
float64: ``split_fused`` (q/k/v part by part), ``wd_scale: step``, ``normuon``, ``wd_schedule: linear``, their
state across a save, and their config checks. The references' own numbers: tests/train/test_muon_peers.py."""
import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.models.lm import build_model
from fpscale.train.muon import MuonAdamW, newton_schulz
from fpscale.train.optimizers import apply_schedule, build_optimizer


def group(params, **kw) -> dict:
    return {"params": params, "kind": "muon", "lr": 0.05, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False,
            "ns_steps": 5, "ns_dtype": "fp64", "ns_coefficients": "quintic", "shape_scale": "keller",
            "cautious": False, **kw}


def one_step(p: torch.nn.Parameter, g: torch.Tensor, **kw) -> torch.Tensor:
    """The change of ``p`` after one step on gradient ``g`` (momentum 0: the update is the gradient's)."""
    before = p.detach().clone()
    p.grad = g.clone()
    MuonAdamW([group([p], **kw)]).step()
    return p.detach() - before


def test_split_fused_orthogonalises_each_part():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 16, dtype=torch.float64))
    p.fused = (0, 3)                              # [q; k; v], as optimizers.mark_fused marks w_qkv
    g = torch.randn(48, 16, dtype=torch.float64)
    parts = torch.cat([newton_schulz(c, 5, torch.float64) for c in g.chunk(3)])
    assert torch.allclose(one_step(p, g), -0.05 * parts, atol=1e-14)
    whole = newton_schulz(g, 5, torch.float64) * 3 ** 0.5
    assert torch.allclose(one_step(p, g, split_fused=False), -0.05 * whole, atol=1e-14)
    assert (parts - whole).norm() / parts.norm() > 0.3        # the two updates are far apart


def test_mark_fused_marks_every_fused_projection():
    cfg = fpscale.load_config(None, ["train.optimizer=muon_adamw"])
    model = build_model(cfg)
    build_optimizer(model, cfg)
    fused = {n: p.fused for n, p in model.named_parameters() if getattr(p, "fused", None)}
    assert fused == {"layers.0.attn.w_qkv": (0, 3), "layers.1.attn.w_qkv": (0, 3)}


@pytest.mark.parametrize("cautious", [False, True])
def test_wd_scale_step_scales_the_decay_like_the_step(cautious):
    torch.manual_seed(1)
    w = torch.randn(48, 16, dtype=torch.float64)
    g = torch.randn(48, 16, dtype=torch.float64)
    o = newton_schulz(g, 5, torch.float64) * 3 ** 0.5          # Keller's scale of a 48 x 16 matrix: sqrt(3)
    mask = (o * w >= 0).double() if cautious else torch.ones_like(w)
    for scale, d in (("lr", 1.0), ("step", 3 ** 0.5)):
        change = one_step(torch.nn.Parameter(w.clone()), g, weight_decay=0.2, wd_scale=scale, cautious=cautious)
        assert torch.allclose(change, -0.05 * 0.2 * d * w * mask - 0.05 * o, atol=1e-14), scale


@pytest.mark.parametrize("shape", [(48, 16), (16, 40)])
def test_normuon_normalises_rows_and_keeps_the_norm(shape):
    """Attractor's muon_step (muon_adamw.py:37-44): v <- lerp(v, mean(O^2 over the long side), 1 - beta2),
    O <- O / sqrt(v) rescaled to O's Frobenius norm; v per row (per column of a wide matrix)."""
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = MuonAdamW([group([p], normuon=True, normuon_beta2=0.9, shape_scale="moonlight")])
    rd = -1 if shape[0] >= shape[1] else -2
    v = torch.zeros(shape[0] if rd == -1 else shape[1], dtype=torch.float64)
    for _ in range(3):
        before = p.detach().clone()
        g = torch.randn(shape, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        o = newton_schulz(g, 5, torch.float64)
        mean = o.square().mean(dim=rd)
        v = 0.9 * v + 0.1 * mean
        n = o / (v.sqrt().unsqueeze(rd))
        n = n * o.norm() / n.norm()
        assert torch.allclose(p.detach() - before, -0.05 * 0.2 * max(shape) ** 0.5 * n, atol=1e-13)
    assert torch.allclose(opt.state[p]["normuon_v"], v, atol=1e-15)


def test_normuon_state_round_trips_exactly():
    torch.manual_seed(3)
    grads = [torch.randn(48, 16, dtype=torch.float64) for _ in range(5)]

    def run(split: bool) -> torch.Tensor:
        p = torch.nn.Parameter(torch.ones(48, 16, dtype=torch.float64))
        p.fused = (0, 3)
        kw = dict(normuon=True, momentum=0.9, nesterov=True, weight_decay=0.1, wd_scale="step", cautious=True)
        opt = MuonAdamW([group([p], **kw)])
        for i, g in enumerate(grads):
            if split and i == 3:
                sd = opt.state_dict()
                opt = MuonAdamW([group([p], **kw)])
                opt.load_state_dict(sd)
            p.grad = g.clone()
            opt.step()
        return p.detach()

    assert torch.equal(run(False), run(True))


def test_wd_schedule_linear_and_momentum_warmup_follow_their_trainer():
    """scripts/train.py:698-710: wd x (1 - step / max_steps), momentum 0.85 -> 0.95 over the warm-up."""
    cfg = fpscale.load_config(None, ["train.optimizer=muon_adamw", "train.steps=10", "train.muon.weight_decay=0.2",
                                     "train.muon.wd_schedule=linear", "train.muon.momentum_warmup=4"])
    opt, _ = build_optimizer(build_model(cfg), cfg)
    muon = next(g for g in opt.param_groups if g["kind"] == "muon")
    for step, wd, momentum in ((0, 0.2, 0.85), (2, 0.16, 0.90), (5, 0.1, 0.95), (10, 0.0, 0.95)):
        apply_schedule(opt.param_groups, step, cfg.train)
        assert muon["weight_decay"] == pytest.approx(wd) and muon["momentum"] == pytest.approx(momentum), step
    assert all(g["eps"] == 1e-8 for g in opt.param_groups if g["kind"] == "adamw")


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="train.muon.normuon_beta2"):
        fpscale.load_config(None, ["train.muon.normuon_beta2=1.0"])
