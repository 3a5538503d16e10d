"""FPSA's per-token, per-head convergence and freezing (``halting: head``; seed 000, App. C.2)."""
import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from tests.models.helpers import tiny_model

FREEZE = {"tol": 1e-5, "max_iter": 60, "stop_quantile": 0.0, "freeze_converged": True, "eta_min": 0.0}


def _attention(model):
    return model.layers[0].attn


def test_a_head_that_converges_first_stops_changing_while_the_others_iterate():
    model = tiny_model("fpsa", halting="head", solver=FREEZE).eval()
    attn = _attention(model)
    with torch.no_grad():             # head 0 attends uniformly whatever the iterate: it converges at once
        attn.log_temp.copy_(torch.tensor([-30.0, 1.5, 1.5, 1.5]))
    seen, step = [], attn.head_step

    def recording(u, *args, **kw):
        seen.append(u.detach().clone().view(u.shape[0], -1, 4, u.shape[-1]))     # [B, T, H, dh]
        return step(u, *args, **kw)

    attn.head_step = recording
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(0)))
    stats = attn.last_stats.to_dict()
    n = stats["iterations"]
    assert len(seen) == n >= 5 and stats["stopped_by"] == "converged"
    # head 0's outputs are bit-identical from the third iterate on; heads 1-3 still move after that
    for k in range(3, n):
        assert torch.equal(seen[k][:, :, 0], seen[2][:, :, 0])
    assert not torch.equal(seen[n - 1][:, :, 1:], seen[3][:, :, 1:])
    heads = stats["head_iterations"]
    assert heads[0] == 1 and min(heads[1], heads[2], heads[3]) > 2      # steps in which each head changed


def test_per_head_gradient_with_freezing_matches_the_per_token_solve():
    """float64: the same fixed point, so the implicit gradients agree whether convergence is judged per
    token over d_model without freezing, or per (token, head) with freezing in the forward and adjoint."""
    tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    grads = []
    for halting, freeze in (("token", False), ("head", True)):
        solver = {"tol": 1e-11, "max_iter": 200, "stop_quantile": 0.0, "eta_min": 0.0, "backward_tol": 1e-11,
                  "backward_max_iter": 200, "freeze_converged": freeze, "backward_freeze": freeze}
        model = tiny_model("fpsa", halting=halting, solver=solver, dtype=torch.float64).train()
        model(tokens, targets=tokens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-6, atol=1e-10), name


def test_cached_decoding_matches_recomputation_per_head():
    solver = {"tol": 1e-6, "max_iter": 300, "freeze_converged": True, "eta_min": 1e-4}
    model = tiny_model("fpsa", halting="head", solver=solver)
    prompt = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    cached, cached_logits = fpscale.generate(model, prompt, 6, use_cache=True, return_logits=True)
    full, full_logits = fpscale.generate(model, prompt, 6, use_cache=False, return_logits=True)
    assert torch.equal(cached, full)
    assert torch.allclose(cached_logits, full_logits, rtol=0, atol=1e-3)


def test_halting_key_is_checked():
    with pytest.raises(ConfigError, match="halting"):
        tiny_model("fpsa", halting="sample")


def test_per_head_iterations_reach_the_logs_and_tensorboard_tags():
    from fpscale.train.metrics import scalars, summarize_layers
    model = tiny_model("fpsa", halting="head", solver=FREEZE).eval()
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4)))
    rows = {name: [s.to_dict()] for name, s in model.layer_stats().items()}
    layers = summarize_layers(rows)
    tags = scalars({"step": 1, "layers": layers})
    name = next(iter(rows))
    per_head = [tags[f"solver/{name}/head_iters_{h}"] for h in range(4)]
    assert per_head == [rows[name][0]["head_iterations"][h] for h in range(4)]
    assert tags[f"solver/{name}/entry_iters_mean"] == sum(per_head) / 4


def test_the_adjoint_iterations_reach_the_statistics():
    model = tiny_model("fpsa", halting="head", solver={**FREEZE, "backward_freeze": True}).train()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(5))
    model(tokens, targets=tokens).backward()
    stats = model.layers[0].attn.last_stats.to_dict()
    assert stats["backward_iterations"] >= 1 and "head_iterations" in stats
