"""The epsilon layer type (seed 003): causal HQSA, per-token halting, its KL, decoding, config errors."""
import math

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.layers.halting import Halting, geometric_prior, halting_kl
from fpscale.layers.hqsa import assignment_entropy, bin_assignment, causal_hqsa
from tests.models.helpers import tiny_config

ATTENTION = ["hqsa", "causal"]


def epsilon_model(attention="hqsa", seed=0, **spec):
    torch.manual_seed(seed)
    cfg = tiny_config("epsilon", d=32, attention=attention, **{"max_steps": 6, "bins": 8, **spec})
    cfg.model.max_seq_len = 160
    return fpscale.build_model(cfg)


def prefix_hqsa(q, k, v, a, eps=1e-6):
    """The paper's HQSA (Sec. 3.3) with the bins summed over the prefix i <= j, position by position."""
    out = torch.empty_like(q)
    for j in range(q.shape[2]):
        m = a[:, :, : j + 1].sum(2)                                                  # [B, H, bins]
        kb = torch.einsum("zhin,zhid->zhnd", a[:, :, : j + 1], k[:, :, : j + 1]) / (m[..., None] + eps)
        vb = torch.einsum("zhin,zhid->zhnd", a[:, :, : j + 1], v[:, :, : j + 1]) / (m[..., None] + eps)
        w = torch.softmax(torch.einsum("zhd,zhnd->zhn", q[:, :, j], kb) / math.sqrt(q.shape[-1]), -1)
        out[:, :, j] = torch.einsum("zhn,zhnd->zhd", w, vb)
    return out


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_causal_hqsa_equals_the_papers_sums_over_the_prefix(chunk):
    """float64, T = 37 (chunks that do not divide it), and split in two calls carrying the sums."""
    g = torch.Generator().manual_seed(0)
    B, H, T, dh, bins = 2, 3, 37, 8, 5
    q, k, v = (torch.randn(B, H, T, dh, generator=g, dtype=torch.float64) for _ in range(3))
    a = torch.softmax(torch.randn(B, H, T, bins, generator=g, dtype=torch.float64) * 2, -1)
    want = prefix_hqsa(q, k, v, a)
    got, state = causal_hqsa(q, k, v, a, chunk=chunk)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    first, past = causal_hqsa(q[:, :, :20], k[:, :, :20], v[:, :, :20], a[:, :, :20], chunk=chunk)
    second, end = causal_hqsa(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], a[:, :, 20:], past, chunk=chunk)
    assert torch.allclose(torch.cat([first, second], 2), want, rtol=1e-10, atol=1e-12)
    assert all(torch.allclose(end[key], state[key], rtol=1e-12) for key in ("k", "v", "m"))
    assert torch.allclose(state["m"], a.sum(2))


@pytest.mark.parametrize("attention", ATTENTION)
def test_epsilon_is_causal_at_evaluation(attention):
    """Changing token 100 of 150 changes nothing before it, exactly (prefix sums, not
    subtractions; halting and the loop's end decided per token), and changes what follows."""
    model = epsilon_model(attention).eval()
    tokens = torch.randint(0, 32, (2, 150), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 100] = (changed[:, 100] + 1) % 32
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :100], b[:, :100])
    assert (a[:, 100:] - b[:, 100:]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ATTENTION)
def test_cached_decoding_equals_the_full_forward(attention):
    """A prompt, then one token at a time and a block of tokens, against one forward of the whole
    sequence; and generation with the cache against generation without it, token for token.
    Halting is pushed to vary by token so that past tokens have halted at different steps."""
    model = epsilon_model(attention, seed=2).eval()
    layer = model.layers[0]
    with torch.no_grad():
        layer.w_halt.normal_(0, 40.0)         # the residual stream is small (embeddings of std 0.02)
        layer.b_halt.fill_(-1.0)
    tokens = torch.randint(0, 32, (2, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        assert layer.last_stats.halt_step.unique().numel() >= 3       # tokens halt at different steps
        caches = model.new_caches()
        parts = [model(tokens[:, :70], caches=caches)]
        for i in range(70, 80):
            parts.append(model(tokens[:, i:i + 1], caches=caches, pos=i))
        parts.append(model(tokens[:, 80:], caches=caches, pos=80))
    assert torch.allclose(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
    cached, cached_logits = fpscale.generate(model, tokens[:, :9], 12, return_logits=True)
    plain, plain_logits = fpscale.generate(model, tokens[:, :9], 12, use_cache=False, return_logits=True)
    assert torch.equal(cached, plain)
    assert torch.allclose(cached_logits, plain_logits, rtol=0, atol=1e-5)


def test_halting_by_hand():
    """lambda = (0.2, 0.3, 0.1) over L = 3 steps: p = (0.2, min(0.3, 0.8), the remainder 0.5);
    lambda = 0.5 twice: p = (0.5, 0.5), halted at step 2 (its remainder spent)."""
    halting = Halting(torch.Size([2]), torch.device("cpu"))
    for t, lam in enumerate([[0.2, 0.5], [0.3, 0.5], [0.1, 0.5]]):
        halting.step(torch.tensor(lam), last=t == 2)
    p = halting.distribution()
    assert torch.allclose(p, torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]]))
    assert halting.halt_step.tolist() == [3, 2] and not halting.running.any()
    # the remainder below the threshold goes to the token's own last step: sums are exactly 1
    near = Halting(torch.Size([1]), torch.device("cpu"), torch.float64)
    near.step(torch.tensor([1 - 1e-7], dtype=torch.float64), last=False)
    assert near.distribution().tolist() == [[1.0]] and near.halt_step.tolist() == [1]


def test_kl_against_a_hand_computed_value():
    """Prior of mean 2 over L = 3: q = 1/2, Q = (1/2, 1/4, 1/4) (the tail folded into step 3).
    P = (0.2, 0.3, 0.5): KL = 0.2 ln(0.2/0.5) + 0.3 ln(0.3/0.25) + 0.5 ln(0.5/0.25)."""
    prior = geometric_prior(2.0, 3, torch.float64)
    assert prior.tolist() == [0.5, 0.25, 0.25]
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    want = [0.2 * math.log(0.4) + 0.3 * math.log(1.2) + 0.5 * math.log(2.0), math.log(2.0)]
    assert halting_kl(p, prior).tolist() == pytest.approx(want, rel=1e-12)
    assert halting_kl(p[1:, :1], prior).item() == pytest.approx(math.log(2.0))    # a loop that ended early
    for mean in (1.0, 1.5, 3.0, 8.0):
        assert geometric_prior(mean, 8, torch.float64).sum().item() == pytest.approx(1.0, abs=1e-12)
    assert geometric_prior(8.0, 1000, torch.float64) @ torch.arange(1, 1001.0, dtype=torch.float64) == \
        pytest.approx(8.0, rel=1e-9)


@pytest.mark.parametrize("attention", ATTENTION)
def test_halting_distributions_sum_to_one_and_set_the_output(attention):
    model = epsilon_model(attention, max_steps=5).train()
    tokens = torch.randint(0, 32, (3, 40), generator=torch.Generator().manual_seed(4))
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    stats = model.layers[0].last_stats
    assert torch.allclose(stats.distribution.sum(-1), torch.ones(3, 39), atol=1e-6)
    assert 1.0 <= float(stats.expected_depth.min()) and float(stats.expected_depth.max()) <= stats.iterations
    # training adds the weighted KL (and the bin-entropy term) to the cross-entropy; evaluation does not
    parts = model.last_losses
    assert parts["aux"] is not None and torch.allclose(loss.detach(), parts["ce"] + parts["aux"])
    assert (stats.bin_entropy is not None) == (attention == "hqsa")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens[:, :-1], targets=tokens[:, 1:]), model.last_losses["ce"])
    assert model.last_losses["aux"] is None


def test_the_loop_ends_when_every_token_halted_and_eval_depth_caps_it():
    model = epsilon_model(max_steps=6).eval()
    tokens = torch.randint(0, 32, (2, 20))
    layer = model.layers[0]
    with torch.no_grad():
        layer.b_halt.fill_(20.0)              # lambda ~ 1: every token halts after the first step
        model(tokens)
        assert layer.last_stats.iterations == 1
        layer.b_halt.fill_(-20.0)             # lambda ~ 0: nobody halts before L_max
        model(tokens)
        assert layer.last_stats.iterations == 6 and layer.last_stats.halt_step.eq(6).all()
        with model.eval_depth(2):
            model(tokens)
        assert layer.last_stats.iterations == 2 and layer.last_stats.halt_step.eq(2).all()
        assert torch.allclose(layer.last_stats.distribution.sum(-1), torch.ones(2, 20))


def test_kl_weight_anneals_like_the_authors():
    spec = fpscale.models.layer_spec("epsilon", kl_anneal_steps=100)
    assert [spec.kl_scale(s) for s in (0, 50, 100, 1000)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert fpscale.models.layer_spec("epsilon").kl_scale(500) == 1.0


@pytest.mark.parametrize("key,value,match", [
    ("max_steps", 0, "must be >= 1"), ("bins", 0, "must be >= 1"), ("latent_dim", 0, "must be >= 1"),
    ("target_halting_mean", 0.5, r"must lie in \[1, max_steps = 8\]"),
    ("target_halting_mean", 9.0, r"must lie in \[1, max_steps = 8\]"), ("alpha_res", 0.0, "must lie in"),
    ("kl_weight", -1.0, "must be >= 0"), ("attention", "full", "must be one of"),
    ("solver", {}, "unknown key"),
])
def test_bad_epsilon_config_names_the_key(key, value, match):
    with pytest.raises(ConfigError, match=rf"'model.layers.0.{key}'.*{match}"):
        fpscale.load_config(None, [f"model.layers=[{{type: epsilon, {key}: {value}}}]"])


@pytest.mark.parametrize("attention", ATTENTION)
def test_a_halted_token_stops_changing(attention, monkeypatch):
    """The state each step starts from, recorded: a token that halted at step s enters every
    later step with the state it had after step s (the authors' code keeps updating it)."""
    model = epsilon_model(attention, seed=5, max_steps=6).eval()
    layer = model.layers[0]
    with torch.no_grad():
        layer.w_halt.normal_(0, 40.0)
        layer.b_halt.copy_(torch.tensor([-3.0, 1.0, -1.0, -1.0, -1.0, -1.0]))
    inputs = []
    block = layer.block
    monkeypatch.setattr(layer, "block", lambda h, *args: inputs.append(h.detach().clone()) or block(h, *args))
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 60), generator=torch.Generator().manual_seed(6)))
    halt = layer.last_stats.halt_step
    steps = layer.last_stats.iterations
    assert steps >= 4 and (halt <= 2).any() and (halt > 3).any()       # some halt early, the loop goes on
    for s in range(1, steps - 1):
        early = halt == s
        for t in range(s + 1, steps):
            assert torch.equal(inputs[t][early], inputs[s][early]), (s, t)
        assert not torch.equal(inputs[s + 1][halt > s + 1], inputs[s][halt > s + 1])   # running tokens move


@pytest.mark.parametrize("config", ["tiny_epsilon", "tiny_mixed_epsilon"])
@pytest.mark.parametrize("cast", ["autocast", "bf16 weights"])
def test_bf16_halts_like_fp32(config, cast):
    """The shipped configs' weights and tokens, one training forward: in bf16 (autocast, or the
    weights cast as DeepSpeed's bf16 mode does) the epsilon layer runs the steps of fp32, its
    expected depth and KL stay within 2% and the loss within 1%."""
    import copy
    import os

    cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{config}.yaml"))
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 129), generator=torch.Generator().manual_seed(7))
    other = copy.deepcopy(model).to(torch.bfloat16) if cast == "bf16 weights" else model
    results = []
    for m, bf16 in ((model, False), (other, True)):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and cast == "autocast"):
            loss = float(m(tokens[:, :-1], targets=tokens[:, 1:]))
        (stats,) = [s for name, s in m.layer_stats().items() if "epsilon" in name]
        results.append((loss, stats.iterations, float(stats.expected_depth.mean()), float(stats.kl)))
    (loss32, steps32, depth32, kl32), (loss16, steps16, depth16, kl16) = results
    assert steps16 == steps32 and steps32 > 1
    assert depth16 == pytest.approx(depth32, rel=0.02) and kl16 == pytest.approx(kl32, rel=0.02)
    assert loss16 == pytest.approx(loss32, rel=0.01)


def test_the_bin_entropy_has_a_finite_gradient_where_a_softmax_underflowed_to_zero():
    """A sharp bin assignment underflows to exact zeros (here a temperature of 1e-3 against logits 1 apart):
    the entropy is xlogy's value, its gradient xlogy's where every probability is positive, and finite where
    one is 0 (xlogy's was NaN there: tiny_epsilon's training went non-finite at step 51 on the bundled corpus)."""
    torch.manual_seed(0)
    k = 0.05 * torch.randn(2, 4, 8, 16, dtype=torch.float64)
    w_bin, prototypes = torch.randn(8, 16, dtype=torch.float64), torch.randn(4, 16, 8, dtype=torch.float64)
    for log_tau, zeros in ((0.0, False), (math.log(1e-3), True)):
        lt = torch.full((4,), log_tau, dtype=torch.float64)
        for dtype in (torch.float64, torch.float32):
            logits = (torch.nn.functional.linear(k, w_bin) @ prototypes.transpose(-1, -2)).to(dtype).requires_grad_()
            a = torch.softmax(logits / lt.exp().clamp_min(1e-3).view(1, -1, 1, 1).to(dtype), dim=-1)
            assert bool((a == 0).any()) == zeros
            ent = assignment_entropy(a)
            (grad,) = torch.autograd.grad(ent, logits, retain_graph=True)
            assert torch.isfinite(grad).all()
            ref = -torch.xlogy(a, a).sum(-1).sum(1).mean()
            assert ent.item() == pytest.approx(ref.item(), rel=1e-6)
            (ref_grad,) = torch.autograd.grad(ref, logits)
            if zeros:
                assert not torch.isfinite(ref_grad).all()      # what the old formula gave
            else:
                torch.testing.assert_close(grad, ref_grad)
    assert bin_assignment(k, w_bin, prototypes, torch.zeros(4, dtype=torch.float64)).shape == (2, 4, 8, 16)
