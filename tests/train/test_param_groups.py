"""Weight decay: matrices are decayed; norms, biases, scalars and embeddings are not."""
import os

import fpscale
from fpscale.train.trainer import param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_weight_decay_reaches_matrices_only():
    model = fpscale.build_model(fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml")))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed | kept == set(names.values()) and not decayed & kept
    for matrix in ("layers.0.attn.w_qkv", "layers.0.mlp.w_down", "layers.1.attn.w_q", "layers.2.mixer.w_in",
                   "layers.3.w_qkv", "layers.3.w_gate", "layers.4.attn.w_o"):
        assert matrix in decayed, matrix
    for name in ("embed.weight",                                           # embedding
                 "norm.weight", "layers.0.norm1.weight", "layers.2.mixer.out_norm_w",   # norms
                 "layers.3.attn_norm", "layers.3.mlp_norm",              # the looped core's (stacked) norms
                 "layers.2.mixer.conv_b", "layers.2.mixer.dt_bias",      # biases
                 "layers.1.attn.log_temp", "layers.3.a1_logit",          # scalars
                 "layers.2.mixer.A_log"):                                # marked, as in mamba_ssm
        assert name in kept, name


def test_a_tensor_parallel_slice_keeps_its_no_decay_mark():
    """parallelize replaces a split parameter by its slice: FP-Mamba's A_log stays undecayed under TP."""
    from fpscale.parallel.parallelize import parallelize
    from fpscale.parallel.state import ParallelState
    model = parallelize(fpscale.build_model(fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml"))),
                        ParallelState(tp_size=2))
    _, no_decay = param_groups(model, 0.1)
    assert any(p is model.layers[2].mixer.A_log for p in no_decay["params"])


# -- train.optimizer: muon_adamw, groups by role (fpscale/train/optimizers.py) ---------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from fpscale.errors import ConfigError  # noqa: E402
from fpscale.layers.registry import LAYER_TYPES  # noqa: E402
from fpscale.train.muon import MuonAdamW  # noqa: E402
from fpscale.train.optimizers import NOT_A_MATRIX, assign, build_optimizer  # noqa: E402

SMALL = ["model.d_model=64", "model.n_heads=4", "model.vocab_size=256", "model.max_seq_len=32", "data.seq_len=16",
         "data.source=synthetic"]


def small_model(layer: str, *extra: str):
    cfg = fpscale.load_config(None, [f"model.layers=[{{type: {layer}}}]", *SMALL, "train.optimizer=muon_adamw", *extra])
    return fpscale.build_model(cfg), cfg


@pytest.mark.parametrize("layer", list(LAYER_TYPES))
def test_every_block_matrix_of_every_layer_type_is_in_muon(layer):
    """No >= 2-D block weight lands in AdamW without a stated reason (a norm, a table a layer marks
    _no_weight_decay, or NOT_A_MATRIX); no embedding, norm or 1-D parameter lands in Muon."""
    model, cfg = small_model(layer)
    where = assign(model, cfg.train)
    params = dict(model.named_parameters())
    assert where.keys() == params.keys()
    for name, group in where.items():
        p = params[name]
        if group == "muon":
            assert p.dim() >= 2 and name.startswith("layers.") and "norm" not in name, name
        elif name.startswith("layers.") and p.dim() >= 2:
            reason = "norm" in name or getattr(p, "_no_weight_decay", False) or name.split(".")[-1] in NOT_A_MATRIX
            assert reason and group in ("norm", "other"), f"{name} {tuple(p.shape)} silently in {group}"
    assert where["embed.weight"] == "embed" and where["norm.weight"] == "norm"
    assert any(g == "muon" for g in where.values())


def test_the_exceptions_name_parameters_that_exist():
    """Every NOT_A_MATRIX entry is a parameter of some registered layer type (no stale exception)."""
    seen = set()
    for layer in LAYER_TYPES:
        seen |= {n.split(".")[-1] for n, _ in small_model(layer)[0].named_parameters()}
    assert set(NOT_A_MATRIX) <= seen


def test_an_untied_output_layer_is_head_and_the_stacked_core_is_muon():
    model, cfg = small_model("looped", "model.tie_embeddings=false")
    where = assign(model, cfg.train)
    assert where["lm_head"] == "head"
    assert {where[f"layers.0.{w}"] for w in ("w_qkv", "w_o", "w_gate", "w_up", "w_down")} == {"muon"}
    assert where["layers.0.attn_norm"] == "norm" and where["layers.0.a1_logit"] == "scalar"


def test_group_override_moves_a_layer_and_bad_overrides_name_the_key():
    model, cfg = small_model("attn", "train.group_override={layers.0: matrix}")
    where = assign(model, cfg.train)
    assert all(g == "matrix" for n, g in where.items() if n.startswith("layers.0."))
    model, cfg = small_model("attn", "train.group_override={layers.7: matrix}")
    with pytest.raises(ConfigError, match="train.group_override.layers.7.*names no parameter"):
        assign(model, cfg.train)
    model, cfg = small_model("attn", "train.group_override={layers.0.norm1.weight: muon}")
    with pytest.raises(ConfigError, match="Muon needs a matrix"):
        assign(model, cfg.train)
    with pytest.raises(ConfigError, match="train.group_override.layers.0.*muon_adamw"):
        fpscale.load_config(None, [*SMALL, "train.group_override={layers.0: muon}"])


def test_build_optimizer_groups_lrs_and_printout():
    model, cfg = small_model("fpmamba", "train.lr_scale.embed=3.0", "train.group_weight_decay.muon=0.2")
    opt, lines = build_optimizer(model, cfg)
    assert isinstance(opt, MuonAdamW)
    by = {name: g for g in opt.param_groups for name in g["group"].split("+")}
    assert by["muon"]["weight_decay"] == 0.2 and by["muon"]["momentum"] == 0.95 and by["muon"]["ns_steps"] == 5
    assert by["embed"]["lr_scale"] == 3.0
    # groups of equal settings merge: A_log (other, undecayed), norms and scalars
    assert any({"other", "norm", "scalar"} <= set(g["group"].split("+")) for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    text = "\n".join(lines)
    assert "layers.0.mixer.w_in" in text and "layers.0.mixer.A_log" in text and "embed.weight" in text
    from fpscale.train.optimizers import apply_schedule
    lr = apply_schedule(opt.param_groups, 10_000, cfg.train)
    assert by["embed"]["lr"] == pytest.approx(3.0 * lr)


@pytest.mark.parametrize("override, message", [
    ("train.lr_scale.muonn=2", "unknown parameter group 'muonn'"),
    ("train.lr_scale.muon=0", "must be > 0"),
    ("train.group_betas.embed=[0.9]", r"\[beta1, beta2\]"),
    ("train.muon.momentum=1.0", r"train.muon.momentum.*\[0, 1\)"),
    ("train.muon.ns_steps=0", "train.muon.ns_steps"),
    ("train.optimizer=sgd", "train.optimizer"),
])
def test_bad_optimizer_keys_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        fpscale.load_config(None, [*SMALL, override])


def test_tp_slices_keep_their_groups():
    from fpscale.parallel.parallelize import parallelize
    from fpscale.parallel.state import ParallelState
    model, cfg = small_model("looped")
    whole = assign(model, cfg.train)
    split = assign(parallelize(model, ParallelState(tp_size=2)), cfg.train)
    assert split == whole
    assert torch.is_tensor(next(iter(model.parameters())))
