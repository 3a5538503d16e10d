"""fpscale's ``attractor`` model with jacobfa/Attractor's weights reproduces their model's numbers
(tests/fixtures/attractor_parity.safetensors, produced by their code at fcf045f in float64: see the
fixture folder's README): logits and y* to 1e-6, the forward's iteration count equal, and the
gradients of both backwards (their ``onestep`` = fpscale ``neumann1``; their Anderson adjoint =
fpscale ``implicit`` with the attractor Anderson variant) to 1e-6 relative."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open

import fpscale
from fpscale.config import config_from_dict
from fpscale.errors import UserError
from fpscale.models.attractor_weights import fpscale_config, to_fpscale, to_theirs
from fpscale.models.lm import build_model

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "attractor_parity.safetensors")


def load_fixture():
    with safe_open(FIXTURE, "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = json.loads(fh.metadata()["meta"])
    return tensors, meta


def their_weights(tensors):
    return {k.removeprefix("weight."): v for k, v in tensors.items() if k.startswith("weight.")}


def build(meta, tensors, backward: str):
    data = fpscale_config({**meta["settings"], "_class_name": "AttractorConfig", "backward_type": backward})
    data["model"]["loss_chunk"] = 0
    cfg = config_from_dict({**data, "data": {"seq_len": 8}})
    model = build_model(cfg).double()
    model.load_state_dict(to_fpscale(their_weights(tensors), meta["settings"]))
    return model, cfg


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def compare(backward: str) -> dict:
    """fpscale's model on the fixture's batch against their model's numbers: the largest differences of c, y*
    and the logits, the iteration counts (ours, theirs) and each gradient's relative difference."""
    tensors, meta = load_fixture()
    model, _ = build(meta, tensors, backward)
    model.train()
    seen = {}
    head = model.layers[-1]
    head.register_forward_hook(lambda m, args, out: seen.update(c=args[0].detach(), y=out.detach()))
    tokens, labels = tensors["input_ids"], tensors["labels"]
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    stats = model.solver_stats()["layers.2.attractor"]
    grads = to_theirs({n: p.grad for n, p in model.named_parameters()}, model.cfg)
    return {"c": float((seen["c"] - tensors[f"{backward}.c"]).abs().max()),
            "y": float((seen["y"] - tensors[f"{backward}.y_star"]).abs().max()),
            "logits": float((logits.detach() - tensors[f"{backward}.logits"].double()).abs().max()),
            "iterations": (stats.iterations, meta[backward]["iters"]),
            "backward_iterations": (stats.backward_iterations, meta[backward].get("backward", {}).get("iters")),
            "grads": {name.removeprefix(f"{backward}.grad."): rel(grads[name.removeprefix(f"{backward}.grad.")], want)
                      for name, want in tensors.items() if name.startswith(f"{backward}.grad.")}}


@pytest.mark.parametrize("backward", ["onestep", "anderson"])
def test_attractor_matches_their_model(backward):
    got = compare(backward)
    assert got["c"] < 1e-6 and got["y"] < 1e-6 and got["logits"] < 1e-6, got
    assert got["iterations"][0] == got["iterations"][1]
    if backward == "anderson":
        assert got["backward_iterations"][0] == got["backward_iterations"][1]
    assert got["grads"] and all(r < 1e-6 for r in got["grads"].values()), got["grads"]


def test_the_parity_table_of_docs_attractor_md_is_this_comparison():
    """docs/attractor.md's "Parity" table, recomputed (two forward and backward passes of the fixture's small
    model in float64, well under a second) and compared as printed."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "attractor.md")).read()
    table = text[text.index("| | max difference | |"):].split("\n\n")[0].splitlines()[2:]
    stated = {cells[0]: cells[1] for cells in ([c.strip() for c in row.strip().strip("|").split("|")]
                                              for row in table)}
    def sci(x: float) -> str:      # as the page prints it: 1.8e-7
        return f"{x:.1e}".replace("e-0", "e-")

    one, anderson = compare("onestep"), compare("anderson")
    assert max(one["c"], anderson["c"]) < 1e-6 and stated["c (backbone output)"] == "< 1e-6"
    measured = {
        "y*": sci(max(one["y"], anderson["y"])),
        "logits": sci(max(one["logits"], anderson["logits"])),
        "forward iterations": "{} = {}".format(*one["iterations"]),
        f"gradients, Neumann-1 ({len(one['grads'])} tensors)": f"{sci(max(one['grads'].values()))} relative (worst)",
        "gradients, Anderson adjoint": "{} relative (worst); adjoint iterations {} = {}".format(
            sci(max(anderson["grads"].values())), *anderson["backward_iterations"])}
    assert anderson["iterations"] == one["iterations"]
    assert {k: stated.get(k) for k in measured} == measured, "docs/attractor.md's parity table differs from " \
        "the comparison (re-measure: python -m pytest tests/models/test_attractor_parity.py and write these)"


def test_round_trip_is_bit_exact():
    tensors, meta = load_fixture()
    theirs = their_weights(tensors)
    _, cfg = build(meta, tensors, "onestep")
    back = to_theirs(to_fpscale(theirs, meta["settings"]), cfg.model)
    for name, t in theirs.items():
        assert torch.equal(back[name], t), name


def test_convert_cli_their_folder_to_fpscale_and_back(tmp_path):
    """launch/convert.py --from attractor (their save_pretrained folder) -> fpscale's whole weights, which
    load and compute their logits; --to attractor writes their folder back with the same tensors."""
    from fpscale.cli.convert import main
    tensors, meta = load_fixture()
    theirs = their_weights(tensors)
    theirs["lm_head.weight"] = theirs["transformer.wte.weight"]
    folder = tmp_path / "theirs"
    folder.mkdir()
    torch.save(theirs, folder / "model.pt")
    (folder / "config.json").write_text(json.dumps({**meta["settings"], "_class_name": "AttractorConfig"}))
    assert main(["--from", "attractor", str(folder), "--out", str(tmp_path / "fp")]) == 0
    model = fpscale_model(tmp_path / "fp")
    assert (model(tensors["input_ids"]) - tensors["onestep.logits"].double()).abs().max() < 1e-6
    assert main(["--checkpoint", str(tmp_path / "fp"), "--to", "attractor", "--out", str(tmp_path / "back")]) == 0
    back = torch.load(tmp_path / "back" / "model.pt", weights_only=True)
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[k], t) for k, t in theirs.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("n_embd", "num_attention_heads", "intermediate_size", "n_backbone_layers", "n_fp_blocks", "max_iter",
                "min_iter", "tol", "anderson_m", "anderson_beta", "backward_tol", "layer_scale_init", "gamma_max",
                "qk_norm", "norm_eps"):
        assert config[key] == meta["settings"][key], key


def test_to_attractor_takes_their_solve_or_the_recipes_causal_form():
    """The causal recipe (configs/tiny_attractor.yaml) converts with a warning that their code solves per
    sample; their solve converts silently; any other solve is refused, naming the keys."""
    from fpscale.models.attractor_weights import their_config
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_attractor.yaml")
    with pytest.warns(UserWarning, match="solves per sample"):
        assert their_config(fpscale.load_config(recipe, []))["solver"] == "anderson"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        their_config(fpscale.load_config(recipe, ["solver.forward.decisions=sample", "solver.forward.norm=sample_l2",
                                                  "solver.compat.anderson_variant=attractor"]))
    with pytest.raises(UserError, match="norm / decisions / anderson_variant = inf / token"):
        their_config(fpscale.load_config(recipe, ["solver.forward.norm=inf"]))


def fpscale_model(folder):
    from fpscale.train.checkpoint import whole_weights
    weights, config = whole_weights(str(folder))
    model = build_model(config_from_dict({**config, "model": {**config["model"], "loss_chunk": 0}})).double()
    model.load_state_dict(weights)
    return model.eval()


def test_their_gpt_baseline_with_value_embeddings():
    """Their same-label GPT baseline (value embeddings on every other layer, the last included; fixture
    attractor_gpt_parity.safetensors, their code in float64): fpscale's attn layers with ``value_embed``
    and their weights give their logits to 1e-6 and their gradients to 1e-6 relative."""
    from fpscale.models.attractor_weights import gpt_to_fpscale
    with safe_open(os.path.join(os.path.dirname(FIXTURE), "attractor_gpt_parity.safetensors"), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        s = json.loads(fh.metadata()["meta"])["settings"]
    layer = "{type: attn, mlp: relu2, qk_norm: true"
    layers = [layer + ("}" if i % 2 != (s["n_layer"] - 1) % 2 else ", value_embed: true}") for i in range(s["n_layer"])]
    cfg = config_from_dict({"model": {
        "vocab_size": s["vocab_size"], "d_model": s["n_embd"], "n_heads": s["num_attention_heads"],
        "mlp_ratio": s["intermediate_size"] / s["n_embd"], "max_seq_len": s["block_size"], "rope_theta": 50000.0,
        "norm_eps": 1e-5, "loss_chunk": 0, "layers": [__import__("yaml").safe_load(x) for x in layers]},
        "data": {"seq_len": 8}})
    model = build_model(cfg).double()
    their = {k.removeprefix("weight."): v for k, v in tensors.items() if k.startswith("weight.")}
    model.load_state_dict(gpt_to_fpscale(their, s["n_layer"], s["num_attention_heads"]))
    logits = model(tensors["input_ids"])
    assert (logits - tensors["logits"].double()).abs().max() < 1e-6
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tensors["labels"].flatten()).backward()
    ours = {n: p.grad for n, p in model.named_parameters()}
    want = gpt_to_fpscale({k.removeprefix("grad."): v for k, v in tensors.items() if k.startswith("grad.")},
                          s["n_layer"], s["num_attention_heads"])
    assert ours.keys() == want.keys() and any("value_embed" in k for k in ours)
    for name in want:
        assert rel(ours[name], want[name]) < 1e-6, (name, rel(ours[name], want[name]))
