"""FPSA-LH: learned ACT halting per token and head (seed 000, Sec. 4.5, App. F.1)."""
import math

import torch

import fpscale
from tests.models.helpers import tiny_model


def _constant_gates(model, lams):
    """Every head's gate outputs a constant lambda (its second layer zeroed, its bias logit(lambda))."""
    attn = model.layers[0].attn
    with torch.no_grad():
        attn.gate_w2.zero_()
        attn.gate_b2.copy_(torch.tensor([math.log(p / (1 - p)) for p in lams], dtype=attn.gate_b2.dtype))
    return attn


def test_halting_distribution_sums_to_one_and_ponder_cost_is_act():
    model = tiny_model("fpsa_lh", max_steps=5, ponder_cost=0.5, dtype=torch.float64).train()
    attn = _constant_gates(model, [0.6, 0.3, 0.3, 0.3])
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    model(tokens, targets=tokens)
    stats = attn.last_stats
    p = stats.distribution.view(2, 4, 6, -1)                      # [B, H, T, steps]
    assert torch.allclose(p.sum(-1), torch.ones(2, 4, 6, dtype=p.dtype))
    # by hand: lambda 0.6 -> p = (0.6, 0.4): N 2, R 0.4; lambda 0.3 -> (0.3, 0.3, 0.3, 0.1): N 4, R 0.1
    assert torch.allclose(p[:, 0, :, :2], torch.tensor([0.6, 0.4], dtype=p.dtype))
    assert torch.allclose(p[:, 1:, :, :4], torch.tensor([0.3, 0.3, 0.3, 0.1], dtype=p.dtype))
    assert stats.iterations == 4
    rho = (2.4 + 3 * 4.1) / 4
    assert abs(stats.kl.item() - rho) < 1e-9 and abs(attn.aux_loss.item() - 0.5 * rho) < 1e-9
    assert attn.last_stats.to_dict()["ponder"] == stats.kl.item()


def test_causal_and_cached_decoding_matches_recomputation():
    model = tiny_model("fpsa_lh", max_steps=6, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 32, (2, 10), generator=g)
    b = a.clone()
    b[:, 6:] = torch.randint(0, 32, (2, 4), generator=g)
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.allclose(la[:, :6], lb[:, :6], rtol=0, atol=1e-12)
    cached, cl = fpscale.generate(model, a[:, :5], 5, use_cache=True, return_logits=True)
    full, fl = fpscale.generate(model, a[:, :5], 5, use_cache=False, return_logits=True)
    assert torch.equal(cached, full) and torch.allclose(cl, fl, rtol=0, atol=1e-10)


def test_gate_learns_from_the_loss():
    model = tiny_model("fpsa_lh", max_steps=3).train()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    model(tokens, targets=tokens).backward()
    attn = model.layers[0].attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (attn.gate_w2, attn.gate_b2))
