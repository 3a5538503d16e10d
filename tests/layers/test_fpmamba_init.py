"""``init: authors`` (issue 36): the FP-Mamba presets start where dr-faustus/fp-rnn starts.

The expected law of each weight is written out from their code (models/fp_mamba_block.py,
models/mixer.py, mamba_ssm's ``_init_weights``; ``FPMambaMixer.init_authors`` cites the lines):
U(+-b) with b = 1/sqrt(fan_in), scaled by 1/sqrt(n_layer) for the output projection. A sample of
n draws of U(+-b) has standard deviation b/sqrt(3) with a sampling error of (b/sqrt(3))/sqrt(5n)
(the variance of s^2 is (mu_4 - sigma^4)/n = 4b^4/(45n)); the test allows 4 of those, and the
support: no |w| above b. fpscale's N(0, 0.02) fails the same test (checked, so the test can fail).
"""
import math

import pytest
import torch

import fpscale
from fpscale.config import config_from_dict
from fpscale.models import layer_spec

D, DS, RANK, NL = 64, 8, 4, 2         # d_inner 128, dt_rank 4


def model(init=None, preset="authors_state_tracking", mixer="householder", seed=0, **extra):
    layer = {"type": "fpmamba", "preset": preset, "mixer": mixer, "mixer_rank": RANK if mixer != "kronecker" else 1,
             "d_state": DS, "repeat": NL, **extra}
    if init is not None:
        layer["init"] = init
    cfg = config_from_dict({"seed": seed, "model": {"vocab_size": 16, "d_model": D, "n_heads": 4, "max_seq_len": 32,
                                                    "layers": [layer]},
                            "train": {"micro_batch": 4, "global_batch": 4},
                            "data": {"source": "synthetic", "seq_len": 32}})
    torch.manual_seed(seed)
    return fpscale.build_model(cfg)


def expected(name: str, mixer) -> float | None:
    """The bound b of U(+-b) that the authors' code draws ``name`` from (None: not a uniform draw)."""
    di, dt_rank = 2 * D, math.ceil(D / 16)
    bounds = {"w_in": D ** -0.5, "conv_w": 4 ** -0.5, "conv_b": 4 ** -0.5, "x_proj": di ** -0.5,
              "dt_proj": dt_rank ** -0.5, "w_out": di ** -0.5 / math.sqrt(NL),
              # the y feedback (feedback_init: linear): bc_y_proj and z_y_proj are Linear(d_inner, .)
              "y_proj": di ** -0.5, "z_y_proj": di ** -0.5}
    if name.startswith("mix_") and name[-2:] in ("_x", "_y"):
        return (2 * di) ** -0.5            # their one Linear of [x; y_{t-1}]
    return bounds.get(name)


def uniform_within_sampling_error(w: torch.Tensor, bound: float) -> tuple[bool, str]:
    n = w.numel()
    sigma = bound / math.sqrt(3)
    err = sigma / math.sqrt(5 * n)
    std, mean, top = float(w.std()), float(w.mean()), float(w.abs().max())
    ok = abs(std - sigma) <= 4 * err and abs(mean) <= 4 * sigma / math.sqrt(n) and top <= bound * (1 + 1e-6)
    return ok, f"n {n}: std {std:.5f} vs {sigma:.5f} +- {err:.5f}, mean {mean:.2e}, max {top:.5f} vs {bound:.5f}"


@pytest.mark.parametrize("preset,mixer", [("authors_state_tracking", "householder"), ("authors_lm", "householder"),
                                          ("authors_state_tracking", "kronecker")])
def test_the_presets_start_from_the_authors_distributions(preset, mixer):
    m = model(preset=preset, mixer=mixer)
    seen = set()
    for layer in m.layers:
        mixer_mod = layer.mixer
        assert mixer_mod.wn_groups, "the presets weight-norm the mixer and the feedback projections"
        for name, p in mixer_mod.named_parameters(recurse=False):
            b = expected(name, mixer)
            if b is None:
                continue
            seen.add(name)
            ok, why = uniform_within_sampling_error(p.detach(), b)
            assert ok, f"{name}: {why}"
        # the weight-norm gains are recomputed from the redrawn weights: W = g v / ||v|| = v
        for gain, names in mixer_mod.wn_groups.items():
            rows = torch.cat([getattr(mixer_mod, n).detach() for n in names], 1).norm(dim=1)
            assert torch.allclose(getattr(mixer_mod, gain).detach(), rows, rtol=1e-6), gain
        w = mixer_mod.weights()
        for n in ("mix_a_x", "y_proj"):
            assert torch.allclose(w[n], getattr(mixer_mod, n), rtol=1e-5, atol=1e-7)
        assert torch.equal(mixer_mod.mix_a_b, torch.zeros_like(mixer_mod.mix_a_b))     # their zeroed bias
        dt = torch.nn.functional.softplus(mixer_mod.dt_bias.detach())
        assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5)
    want = {"w_in", "x_proj", "dt_proj", "w_out", "y_proj", "mix_a_x", "mix_a_y"}
    want |= {"conv_w", "conv_b"} if preset == "authors_lm" else {"z_y_proj"}
    want |= {"mix_u_x", "mix_u_y"} if mixer == "householder" else {"mix_k1_x", "mix_k2_x", "mix_k1_y", "mix_k2_y"}
    assert want <= seen, want - seen


def test_fpscale_init_fails_the_same_check_and_the_preset_can_keep_it():
    """The statistics test can fail: the preset with ``init: fpscale`` (N(0, 0.02)) is outside it."""
    m = model(init="fpscale")
    mixer = m.layers[0].mixer
    for name in ("w_in", "x_proj", "mix_u_x", "w_out"):
        ok, why = uniform_within_sampling_error(mixer.get_parameter(name).detach(), expected(name, "householder"))
        assert not ok, f"{name} passed under init: fpscale ({why})"
    assert float(mixer.w_in.detach().std()) == pytest.approx(0.02, rel=0.05)


def test_init_is_a_validated_per_layer_key():
    assert layer_spec("fpmamba").init == "fpscale"
    assert layer_spec("fpmamba", preset="authors_lm").init == "authors"             # the preset's value
    assert layer_spec("fpmamba", preset="authors_lm", init="fpscale").init == "fpscale"   # a key given wins
    assert layer_spec("fpmamba", init="authors").init == "authors"
    assert layer_spec("attn").init == "fpscale"
    with pytest.raises(fpscale.ConfigError, match=r"'layer.init': layer type 'attn' has no initialisation "
                                                  r"'authors': one of fpscale"):
        layer_spec("attn", init="authors")
    with pytest.raises(fpscale.ConfigError, match=r"'layer.init': layer type 'fpmamba2' has no initialisation"):
        layer_spec("fpmamba2", init="authors")
    with pytest.raises(fpscale.ConfigError, match=r"'layer.init': .*'xavier': one of fpscale \| authors"):
        layer_spec("fpmamba", init="xavier")
    with pytest.raises(fpscale.ConfigError, match=r"model.layers.0.init"):
        fpscale.load_config(None, ["model.layers=[{type: fpsa, init: authors}]"])


def test_init_authors_still_matches_the_float64_reference():
    """The authors' preset at its own initialisation (no randomising of the parameters) is still
    one application of the authors' f, written out in float64 (test_fpmamba_switches' reference)."""
    from fpscale.layers.fpmamba_map import FPMambaMixer
    from fpscale.solvers import SolverConfig
    from tests.layers.test_fpmamba_switches import inputs, module_apply, reference, sw_of
    torch.manual_seed(0)
    spec = layer_spec("fpmamba", preset="authors_state_tracking", d_state=3)
    assert spec.init == "authors"
    m = FPMambaMixer(8, spec, SolverConfig(), 0.2, 0.2, 1e-6).double()
    m.init_authors(n_layer=1)
    x, y = inputs()
    with torch.no_grad():
        for a, b in zip(module_apply(m, x, y), reference(m, sw_of(spec), x, y)):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), float((a - b).abs().max())
