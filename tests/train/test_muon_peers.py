"""fpscale's MuonAdamW against the references' own numbers (tests/fixtures/muon_peers, written by
scripts/peer_fixtures/make_muon_fixtures.py from jacobfa/Attractor fcf045f and KellerJordan/Muon run
unmodified; the script's docstring says what runs around their code):
  * configs/140m_attractor.yaml's optimizer (every group, lr, decay, betas, eps, NorMuon, momentum warm-up,
    their Muon decay schedule, q/k/v part by part) on a d-16 model with every kind of parameter their
    groups have, 10 steps in float64, equals their MuonAdamW stepped as their trainer steps it, to 1e-6;
  * fpscale's Keller mode equals Keller's MuonWithAuxAdam the same way;
  * Newton-Schulz (quintic) and polar express + NorMuon in bf16 equal theirs.
Their parameter names map to fpscale's through the converter (fpscale.models.attractor_weights)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import fpscale
from fpscale.models.attractor_weights import to_fpscale
from fpscale.models.lm import build_model
from fpscale.train.muon import MuonAdamW, newton_schulz, normuon
from fpscale.train.optimizers import apply_schedule, build_optimizer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "muon_peers")
RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "140m_attractor.yaml")
THEIRS = {"n_embd": 16, "num_attention_heads": 2, "n_backbone_layers": 1, "n_fp_blocks": 1}


def fixture(name: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(FIXTURES, name))


def part(tensors: dict, prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def small_140m():
    """configs/140m_attractor.yaml at d 16: one backbone block, one head block, their optimizer."""
    cfg = fpscale.load_config(RECIPE, ["model.vocab_size=32", "model.d_model=16", "model.n_heads=2",
                                       "model.layers.0.repeat=1", "train.steps=12", "train.muon.ns_dtype=fp64",
                                       "model.loss_chunk=0", "data.seq_len=8", "model.max_seq_len=8"])
    cfg.train.group_override = {k.replace("layers.7.", "layers.1."): v for k, v in cfg.train.group_override.items()}
    return cfg


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_140m_attractor_optimizer_equals_attractors_muon_adamw():
    ref = fixture("attractor_muon_adamw.safetensors")
    cfg = small_140m()
    model = build_model(cfg).double()
    model.load_state_dict(to_fpscale(part(ref, "init/"), THEIRS), strict=True)
    opt, _ = build_optimizer(model, cfg)
    params = dict(model.named_parameters())
    for step in range(1, 11):
        lr = apply_schedule(opt.param_groups, step, cfg.train)
        assert abs(lr / cfg.train.lr - ref["lr_factor"][step - 1].item()) < 1e-12, step
        for name, g in to_fpscale({k: v.double() for k, v in part(ref, f"grad{step}/").items()}, THEIRS).items():
            params[name].grad = g
        opt.step()
    final = to_fpscale(part(ref, "final/"), THEIRS)
    for name, p in model.named_parameters():
        assert relative(p.detach(), final[name]) < 1e-6, (name, relative(p.detach(), final[name]))
    moved = to_fpscale(part(ref, "init/"), THEIRS)
    assert min(relative(final[n], moved[n]) for n in final) > 1e-4      # every parameter moved


def test_split_fused_off_differs_from_attractor():
    """The comparison can fail: q/k/v orthogonalised as one matrix is not their update."""
    ref = fixture("attractor_muon_adamw.safetensors")
    cfg = small_140m()
    cfg.train.muon.split_fused = False
    model = build_model(cfg).double()
    model.load_state_dict(to_fpscale(part(ref, "init/"), THEIRS), strict=True)
    opt, _ = build_optimizer(model, cfg)
    params = dict(model.named_parameters())
    for step in range(1, 11):
        apply_schedule(opt.param_groups, step, cfg.train)
        for name, g in to_fpscale({k: v.double() for k, v in part(ref, f"grad{step}/").items()}, THEIRS).items():
            params[name].grad = g
        opt.step()
    final = to_fpscale(part(ref, "final/"), THEIRS)
    assert relative(params["layers.0.attn.w_qkv"].detach(), final["layers.0.attn.w_qkv"]) > 1e-3


def test_keller_mode_equals_kellers_muon_with_aux_adam():
    ref = fixture("keller_muon.safetensors")
    init = part(ref, "init/")
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    muon = dict(params=[params[n] for n in ("square", "tall", "wide")], kind="muon", lr=0.02, weight_decay=0.1,
                momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="fp64", ns_coefficients="quintic",
                shape_scale="keller", cautious=False, split_fused=False)
    adam = dict(params=[params["embed"], params["gain"]], kind="adamw", lr=3e-3, betas=(0.8, 0.95), eps=1e-10,
                weight_decay=0.01)
    opt = MuonAdamW([muon, adam])
    for step in range(1, 11):
        for n, g in part(ref, f"grad{step}/").items():
            params[n].grad = g.double()
        opt.step()
    for n, p in params.items():
        assert relative(p.detach(), ref[f"final/{n}"]) < 1e-6, n


def test_orthogonalisations_in_bf16_equal_theirs():
    ref = fixture("ns_bf16.safetensors")
    for name in ("tall", "wide", "square"):
        g = ref[f"input/{name}"]
        ours = newton_schulz(g, 5, torch.bfloat16, "quintic")
        assert torch.equal(ours, ref[f"quintic/{name}"]), name
        o = newton_schulz(g, 5, torch.bfloat16, "polar_express")
        v = torch.zeros((g.shape[0], 1) if g.shape[0] >= g.shape[1] else (1, g.shape[1]))
        ours = normuon(o, v, 0.95).float()
        theirs = ref[f"polar_normuon/{name}"]
        assert torch.equal(ours, theirs), (name, relative(ours, theirs))


@pytest.mark.parametrize("size", ["140m", "370m", "770m"])
def test_every_attractor_recipe_sets_their_optimizer(size):
    """The switches the 140m replay above proves, in each recipe, with their head's groups (fp_lr_scale and
    fp_wd of their attractor/configs/attractor/*.py: 0.5 / 0.4 / 0.4 and 0.1)."""
    cfg = fpscale.load_config(RECIPE.replace("140m", size), [])
    t, m = cfg.train, cfg.train.muon
    assert (m.shape_scale, m.ns_coefficients, m.normuon, m.normuon_beta2, m.wd_scale, m.wd_schedule) == (
        "keller", "polar_express", True, 0.95, "step", "linear")
    assert (m.cautious_wd, m.split_fused, m.momentum_warmup, m.momentum_start, m.weight_decay) == (
        True, True, 300, 0.85, 0.2)
    assert (t.eps, t.beta1, t.beta2, t.weight_decay, t.schedule, t.decay_fraction) == (
        1e-10, 0.8, 0.95, 0.0, "wsd", 0.5)
    head = f"layers.{len(cfg.model.expanded_layers()) - 1}"
    assert {k for k, v in t.group_override.items() if v == "other"} == {f"{head}.attn_norm", f"{head}.mlp_norm"}
    fp = {"140m": 0.5, "370m": 0.4, "770m": 0.4}[size]
    assert t.lr_scale["matrix"] == t.lr_scale["other"] == fp and t.group_weight_decay == {"matrix": 0.1}
