"""The ``attractor`` layer: its map and y0, cached decoding, bf16 beside fp32, the block switches' init,
and bad settings named by key. (Parity with their code: test_attractor_parity.py.)"""
from __future__ import annotations

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.models import ModelConfig, layer_spec
from tests.models.helpers import assert_iterates_alike

SOLVER = {"anderson": 5, "anderson_variant": "attractor", "norm": "sample_l2", "decisions": "sample",
          "stop_quantile": 0.0,
          "patience": 0, "eta_min": 0.0, "min_iter": 3, "backward": "neumann1", "mask_unconverged": False}


def tiny(seed=0, head_blocks=2, gate=0.1, solver=None, d=32, embed_init="normal", value_embed=False, **spec):
    cfg = fpscale.load_config(None, [])
    cfg.model = ModelConfig(vocab_size=32, d_model=d, n_heads=4, mlp_ratio=4.0, max_seq_len=64, norm_eps=1e-5,
                            rope_theta=50_000.0, init_std=(2 / (5 * d)) ** 0.5, embed_init=embed_init, layers=[
                                layer_spec("attn", mlp="relu2", qk_norm=True, init="scaled_zero_ortho",
                                           value_embed=value_embed),
                                layer_spec("attractor", head_blocks=head_blocks, gate_init=gate,
                                           solver={**SOLVER, **(solver or {})}, **spec)])
    cfg.model.validate()
    torch.manual_seed(seed)
    return fpscale.build_model(cfg)


def test_the_head_solves_its_map_from_c():
    model = tiny(solver={"tol": 1e-6, "max_iter": 200}).double().eval()
    head = model.layers[1]
    seen = {}
    head.register_forward_hook(lambda m, args, out: seen.update(c=args[0], y=out))
    tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens)
        c, y = seen["c"], seen["y"]
        cos, sin = fpscale.layers.common.rope_span(head.head_dim, 0, 10, head.rope_theta, c)
        fy = head.head(y + c, cos, sin, None) - y          # f(y) = head(y + c) - y
    assert model.solver_stats()["layers.1.attractor"].stopped_by == "converged"
    assert (fy - y).norm() / y.norm() < 1e-5
    with torch.no_grad():     # one iteration is f(c): y0 = c
        model.layers[1].solver.forward.max_iter = model.layers[1].solver.forward.eval_max_iter = 1
        model(tokens)
        cos, sin = fpscale.layers.common.rope_span(head.head_dim, 0, 10, head.rope_theta, c)
        assert torch.allclose(seen["y"], head.head(2 * c, cos, sin, None) - c, atol=1e-12)


def test_cached_decoding_matches_the_full_forward():
    """Their solve (per sample, their Anderson: not causal before convergence) decodes with the cache as the
    full forward within the tolerance; the recipes' causal solve does so exactly, converged or not
    (tests/models/test_causal_eval.py). (The backbone with value embeddings: each decoding step reads its
    new tokens' table rows.)"""
    model = tiny(solver={"tol": 1e-6, "max_iter": 200}, value_embed=True).eval()
    prompt = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    cached, cached_logits = fpscale.generate(model, prompt, 5, use_cache=True, return_logits=True)
    full, full_logits = fpscale.generate(model, prompt, 5, use_cache=False, return_logits=True)
    assert torch.equal(cached, full)
    assert torch.allclose(cached_logits, full_logits, rtol=0, atol=1e-3), \
        float((cached_logits - full_logits).abs().max())


@pytest.mark.parametrize("solve", [
    {"tol": 1e-2},                                                                # theirs: above sample_l2's floor
    {"tol": 2 ** -7, "norm": "l2", "decisions": "token", "anderson_variant": "fpscale"}],   # the recipes': at l2's
    ids=["theirs", "causal"])
def test_bf16_iterates_like_fp32_above_the_floor(solve):
    """Their solve at tol 1e-2 (above the bf16 floor of sample_l2, fpscale.solvers.precision), the recipes'
    causal one at the per-token l2 floor itself (1 bf16 eps): mean iterations of bf16 weights and of
    autocast within 1.25x of fp32's over 3 batches, and none at its cap where fp32 converged."""
    model = tiny(seed=1, d=64, solver={**solve, "max_iter": 40}).eval()
    batches = [torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def iterations(m, autocast=False):
        out = []
        for tokens in batches:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                m(tokens)
            s = m.solver_stats()["layers.1.attractor"]
            out.append((s.iterations, s.stopped_by))
        return {"attractor": out}

    fp32 = iterations(model)
    assert all(stop == "converged" for _, stop in fp32["attractor"]), fp32
    assert_iterates_alike(fp32, iterations(model, autocast=True), "autocast")
    assert_iterates_alike(fp32, iterations(model.to(torch.bfloat16)), "bf16")


def test_scaled_zero_ortho_init():
    model = tiny(d=64, embed_init="trunc_orthogonal")
    std = (2 / (5 * 64)) ** 0.5
    attn = model.layers[0]
    assert attn.attn.w_o.abs().max() == 0 and attn.mlp.w_proj.abs().max() == 0      # backbone outputs zero
    q = attn.attn.w_qkv[:64]
    assert torch.allclose(q @ q.T, torch.eye(64) * std ** 2 * 64, atol=1e-5)       # orthogonal, entries std
    head = model.layers[1]
    assert 0.5 * std < head.w_o.std() < 1.5 * head.w_o.std() and head.w_o.abs().max() <= 3 * std + 1e-7
    gates = torch.sigmoid(head.raw_gamma_attn) * head.gamma_max
    assert torch.allclose(gates, torch.full_like(gates, 0.1))
    assert head.raw_gamma_attn._no_weight_decay
    E = model.embed.weight                          # vocab 32 < d 64: orthonormal rows, entries of std
    assert torch.allclose(E @ E.T, torch.eye(32) * std ** 2 * 64, atol=1e-5)


@pytest.mark.parametrize("bad,key", [({"mlp": "gelu"}, "mlp"), ({"init": "authors2"}, "init"),
                                     ({"head_blocks": 0}, "head_blocks"), ({"gamma_max": 0.0}, "gamma_max")])
def test_bad_settings_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        fpscale.load_config(None, [f"model.layers=[{{type: attractor, {k}: {v}}}]" for k, v in bad.items()])
