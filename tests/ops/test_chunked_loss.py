"""The chunked cross-entropy (fpscale.ops.chunked_loss) against the plain head: the same loss
and gradients of the hidden states and of the output weight, a fraction of the saved bytes."""
import pytest
import torch
import torch.nn.functional as F

import fpscale
from fpscale.errors import ConfigError
from fpscale.models.heads import LMHead
from fpscale.ops.chunked_loss import chunked_cross_entropy
from fpscale.profiling import count_saved_bytes
from tests.models.helpers import tiny_model

TOL64 = dict(rtol=1e-12, atol=1e-14)


def problem(N=37, d=16, V=53, dtype=torch.float64, ignored=(0, 5, 6, 36), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=dtype)
    w = torch.randn(V, d, generator=g, dtype=dtype) * 0.7
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = -100
    return h, w, targets


def loss_and_grads(fn, h, w, targets, upstream=1.0):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, targets)
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


def plain(h, w, targets):
    head = LMHead()
    return head.loss(head(h[None], w), targets[None])


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 4096])       # 5, 8: chunks that do not divide N = 37
def test_float64_loss_and_gradients_equal_the_plain_head(chunk):
    h, w, targets = problem()
    want = loss_and_grads(plain, h, w, targets, upstream=2.5)
    got = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk), h, w, targets, upstream=2.5)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, want):
        assert torch.allclose(a, b, **TOL64), (a - b).abs().max()
    assert torch.all(got[1][[0, 5, 6, 36]] == 0)          # ignored tokens get no gradient


def test_batched_hidden_states_and_the_head_method():
    h, w, targets = problem(N=24, ignored=(1, 23))
    want = loss_and_grads(plain, h, w, targets)
    got = loss_and_grads(lambda h, w, t: LMHead().chunked_loss(h.view(4, 6, -1), w, t.view(4, 6), 7), h, w, targets)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, **TOL64)


def test_every_target_ignored_gives_zero_loss_and_gradient():
    h, w, targets = problem(N=6, ignored=range(6))
    loss, gh, gw = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 4), h, w, targets)
    assert loss == 0 and torch.all(gh == 0) and torch.all(gw == 0)


@pytest.mark.parametrize("chunk", [7, 4096])
def test_bf16_autocast_is_close_to_the_plain_head(chunk):
    """Under bf16 autocast both heads multiply in bf16 and take the softmax in fp32; the loss is
    fp32 and the gradients come back in the inputs' fp32."""
    h, w, targets = problem(N=40, d=32, V=96, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(plain, h, w, targets)
        got = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk), h, w, targets)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    assert torch.allclose(got[0], want[0], rtol=1e-5)              # the same bf16 logits, fp32 softmax
    for a, b in zip(got[1:], want[1:]):                             # bf16 products (other chunk sums)
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    exact = loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.T, t), h, w, targets)
    assert abs(float(got[0]) - float(exact[0])) < 2e-2 * float(exact[0])     # bf16 stays bf16-close


def test_bf16_weights_without_autocast():
    """DeepSpeed's bf16 mode: hidden states and weight in bf16, the softmax still in fp32."""
    h, w, targets = problem(N=40, d=32, V=96, dtype=torch.bfloat16)
    want = loss_and_grads(plain, h, w, targets)
    got = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 16), h, w, targets)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert torch.allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def saved_bytes(fn, h, w, targets) -> int:
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with count_saved_bytes(exclude=(h, w, targets)) as counter:      # parameters and inputs live anyway
        fn(h, w, targets)
    return counter.total


@pytest.mark.slow      # a 412 MB log-softmax computed (2-3 s): the full suite, not the quick loop
def test_saved_bytes_at_a_realistic_shape_are_a_tiny_fraction_of_the_plain_head():
    """N = 2048 tokens, V = 50304, fp32: the plain head saves the fp32 log-softmax (N x V x 4 =
    412 MB); the chunked one its logsumexp per token."""
    N, V, d = 2048, 50304, 64
    h, w = torch.randn(N, d), torch.randn(V, d) * 0.02
    targets = torch.randint(0, V, (N,))
    ours = saved_bytes(lambda h, w, t: chunked_cross_entropy(h, w, t, 512), h, w, targets)
    theirs = saved_bytes(plain, h, w, targets)
    assert theirs >= N * V * 4
    assert ours <= theirs / 10
    assert ours <= N * 4 + 64           # the logsumexp [N] fp32 and the count


def tiny_pair(**kw):
    plain_model = tiny_model("mixed", dtype=torch.float64, **kw)
    chunked = tiny_model("mixed", dtype=torch.float64, **kw)
    plain_model.cfg.loss_chunk = 0
    chunked.cfg.loss_chunk = 13            # 2 x 30 tokens: chunks of 13, 13, 13, 13, 8
    return plain_model, chunked


def test_a_tiny_models_training_loss_and_gradients_are_unchanged():
    plain_model, chunked = tiny_pair()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (2, 31), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100
    for model in (plain_model, chunked):
        model.train()
        model(tokens[:, :-1], targets=targets).backward()
    assert torch.allclose(chunked.last_losses["ce"], plain_model.last_losses["ce"], **TOL64)
    grads = dict(plain_model.named_parameters())
    for name, p in chunked.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-10, atol=1e-13), name
    with torch.no_grad():                  # validation: no grad, the same loss; logits where asked
        assert torch.allclose(chunked.eval()(tokens[:, :-1], targets=targets),
                              plain_model.eval()(tokens[:, :-1], targets=targets), **TOL64)
        assert chunked(tokens).shape == (2, 31, 32)


def test_the_untied_head_gets_its_gradient():
    cfg = fpscale.load_config(None, ["model.tie_embeddings=false", "model.vocab_size=64", "model.d_model=32",
                                     "model.loss_chunk=5"])
    model = fpscale.build_model(cfg).double()
    tokens = torch.randint(0, 64, (2, 9))
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    lm_head_grad = model.lm_head.grad.clone()
    model.zero_grad()
    model.cfg.loss_chunk = 0
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    assert torch.allclose(lm_head_grad, model.lm_head.grad, **TOL64)


def test_loss_chunk_config():
    assert fpscale.load_config(None, []).model.loss_chunk == 4096
    assert fpscale.load_config(None, ["model.loss_chunk=0"]).model.loss_chunk == 0
    with pytest.raises(ConfigError, match="model.loss_chunk"):
        fpscale.load_config(None, ["model.loss_chunk=-1"])
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), 0)
