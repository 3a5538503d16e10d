"""The loss head from liger-kernel (``model.loss_kernel: liger``, fpscale.ops.fused_loss): its loss and
gradients held to the plain head's (logits, then F.cross_entropy) under Triton's interpreter on CPU, alone
and through the model; its dispatch (the chunked head where Triton does not run, said once; the key
validated). The kernel tests (``test_kernel_*``) run in a child with ``TRITON_INTERPRET=1``."""
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import fpscale
from fpscale.errors import ConfigError
from fpscale.ops import fused_loss
from tests.interpreter import run_kernel_tests_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="a kernel test: run under TRITON_INTERPRET=1 by "
                                                         "test_liger_under_the_interpreter (child process)")


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float().flatten(0, -2), y.flatten(), ignore_index=-100)


@interpreted
@pytest.mark.parametrize("shape", [(37,), (2, 19)])
def test_kernel_liger_loss_and_gradients_equal_the_plain_heads(shape):
    g = torch.Generator().manual_seed(0)
    d, V = 24, 101
    h = torch.randn(*shape, d, generator=g, requires_grad=True)
    w = (torch.randn(V, d, generator=g) / 4).requires_grad_()
    y = torch.randint(0, V, shape, generator=g)
    y.view(-1)[::5] = -100                         # ignored positions: left out of the mean
    loss = fused_loss.fused_cross_entropy(h, w, y)
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = plain(ref_h, ref_w, y)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    (loss * 3).backward()                           # a gradient other than 1 reaches the stored ones
    (ref * 3).backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-4, atol=1e-6)


@interpreted
def test_kernel_liger_head_trains_the_model_as_the_chunked_head():
    """tiny_attn with model.loss_kernel liger vs chunked: the same loss and every parameter's gradient."""
    over = ["model.d_model=32", "model.n_heads=2", "model.vocab_size=97", "data.seq_len=16"]
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for kernel in ("liger", "chunked"):
        torch.manual_seed(0)
        cfg = fpscale.load_config("configs/tiny_attn.yaml", [*over, f"model.loss_kernel={kernel}"])
        model = fpscale.build_model(cfg)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_liger_under_the_interpreter():
    assert fused_loss.liger_available() is None, fused_loss.liger_available()     # the dev extra installs it
    run_kernel_tests_interpreted(__file__, "not slow")


def test_liger_falls_back_to_the_chunked_head_where_triton_does_not_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused_loss, "_SAID", set())
    with pytest.warns(UserWarning, match="loss_kernel = liger: Triton does not run on cpu"):
        assert fused_loss.choose("liger", torch.device("cpu")) == "chunked"
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # said once
        assert fused_loss.choose("liger", torch.device("cpu")) == "chunked"
    assert fused_loss.choose("liger", torch.device("cuda")) == "liger"
    assert fused_loss.choose("chunked", torch.device("cuda")) == "chunked"
    cfg = fpscale.load_config("configs/tiny_attn.yaml", ["model.loss_kernel=liger", "model.d_model=32",
                                                         "model.n_heads=2"])
    model = fpscale.build_model(cfg)
    assert model.head.kernel == "liger"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    torch.testing.assert_close(loss, plain(model.hidden(tokens[:, :-1]), model.head_weight(), tokens[:, 1:]))


def test_loss_kernel_key_is_validated():
    with pytest.raises(ConfigError, match="model.loss_kernel"):
        fpscale.load_config(None, ["model.loss_kernel=cut"])
