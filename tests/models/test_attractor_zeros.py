"""The converter keeps jacobfa/Attractor's present-but-zero settings, and their config.json survives a round
trip. tests/fixtures/attractor_zeros.safetensors: their model (fcf045f, unmodified, float64) with their Anderson
adjoint, min_iter 8 and ``backward_min_iter: 0`` (their adjoint stops after 4 iterations) or ``backward_tol:
0.0`` (it runs to its cap, 12); scripts/peer_fixtures/make_attractor_zero_fixtures.py wrote it. fpscale's
model from ``fpscale_config`` of their config gives their iteration counts and gradients (1e-6 relative)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from fpscale.config import config_from_dict
from fpscale.models.attractor_weights import THEIR_DEFAULTS, fpscale_config, their_config, to_fpscale, to_theirs
from fpscale.models.lm import build_model

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "attractor_zeros.safetensors")


def load():
    with safe_open(FIXTURE, "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, json.loads(fh.metadata()["meta"])


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("case", ["min0", "tol0"])
def test_zero_adjoint_settings_give_their_iterations_and_gradients(case):
    tensors, meta = load()
    their = meta[case]["config"]
    data = fpscale_config(their)
    solver = data["model"]["layers"][-1]["solver"]
    assert (solver["adjoint"]["backward_min_iter"], solver["adjoint"]["backward_tol"]) == \
        (their["backward_min_iter"], their["backward_tol"])
    data["model"]["loss_chunk"] = 0
    cfg = config_from_dict({**data, "data": {"seq_len": 8}})
    model = build_model(cfg).double()
    weights = {k.removeprefix("weight."): v for k, v in tensors.items() if k.startswith("weight.")}
    model.load_state_dict(to_fpscale(weights, their))
    model.train()
    logits = model(tensors["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tensors["labels"].flatten())
    assert abs(loss.item() - tensors[f"{case}.loss"].item()) < 1e-6
    loss.backward()
    stats = model.solver_stats()[f"layers.{their['n_backbone_layers']}.attractor"]
    assert stats.iterations == meta[case]["forward"]["iters"]
    assert stats.backward_iterations == meta[case]["adjoint"]["iters"]
    grads = to_theirs({n: p.grad for n, p in model.named_parameters()}, model.cfg)
    for name, want in tensors.items():
        if name.startswith(f"{case}.grad."):
            key = name.removeprefix(f"{case}.grad.")
            assert rel(grads[key], want) < 1e-6, (key, rel(grads[key], want))


def test_their_config_round_trips_exactly():
    """--from attractor then --to attractor: their config.json back key for key (the keys fpscale does not
    hold from the copy kept beside the weights); without that copy, only those keys fall back to their
    defaults, and the head's optimizer scales (fp_lr_scale, fp_wd) come back from fpscale's train groups."""
    _, meta = load()
    for case in ("min0", "tol0"):
        their = meta[case]["config"]
        cfg = config_from_dict({**fpscale_config(their), "name": their["name"], "data": {"seq_len": 8}})
        assert their_config(cfg, their) == their
        bare = their_config(cfg)
        # the true vocabulary (32, padded to 512 here) is one of what fpscale's config does not hold
        assert {k for k in their if bare.get(k) != their[k]} <= (set(THEIR_DEFAULTS) | {"vocab_size"}) - {"name"}
        assert (bare["fp_lr_scale"], bare["fp_wd"], bare["backward_min_iter"], bare["backward_tol"]) == (
            0.5, 0.1, 0, their["backward_tol"])


def test_convert_cli_round_trip_is_exact(tmp_path):
    """launch/convert.py --from attractor, then --to attractor: the same config.json and tensors."""
    from fpscale.cli.convert import main
    tensors, meta = load()
    their = meta["tol0"]["config"]
    weights = {k.removeprefix("weight."): v for k, v in tensors.items() if k.startswith("weight.")}
    weights["lm_head.weight"] = weights["transformer.wte.weight"]      # their state dict holds the tied head
    folder = tmp_path / "theirs"
    folder.mkdir()
    torch.save(weights, folder / "model.pt")
    (folder / "config.json").write_text(json.dumps(their))
    assert main(["--from", "attractor", str(folder), "--out", str(tmp_path / "fp")]) == 0
    assert main(["--checkpoint", str(tmp_path / "fp"), "--to", "attractor", "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == their
    back = torch.load(tmp_path / "back" / "model.pt", weights_only=True)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], t) for k, t in weights.items())
