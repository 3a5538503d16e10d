"""Deep supervision with truncated-backprop windows (fpscale.layers.deep_supervision; seed 004,
Algorithm 2): one window spanning the solve is today's training step; K windows give the gradient of a
hand-written truncated-BPTT reference (float64); the forward is the plain solve's; bf16 beside fp32."""
import os
import warnings

import pytest
import torch

import fpscale
from fpscale.config import config_from_dict
from fpscale.errors import ConfigError
from fpscale.layers.common import rope_span
from tests.models.helpers import token_batches
from tests.parallel.launch import ROOT

V, D, T, B = 11, 16, 8, 4


def build(window: int, dtype=torch.float64, solver: dict | None = None, **model):
    data = {"seed": 0, "model": {"vocab_size": V, "d_model": D, "n_heads": 2, "max_seq_len": 16, "loss_chunk": 0,
                                 "layers": [{"type": "attn"},
                                            {"type": "looped", "core_blocks": 1, "conv": True,
                                             "deep_supervision": {"window": window}},
                                            {"type": "attn"}], **model},
            "solver": {"max_iter": 12, "tol": 1e-3, "backward": "phantom", "phantom_steps": 2, "stop_quantile": 0.0,
                       "patience": 2, "decay": 0.5, **(solver or {})},
            "train": {"micro_batch": B, "global_batch": B}, "data": {"source": "synthetic", "seq_len": T}}
    torch.manual_seed(0)
    m = fpscale.build_model(config_from_dict(data)).to(dtype)
    with torch.no_grad():
        m.layers[1].conv_w.normal_(0, 0.1)          # the re-injected input's conv counts too
    return m.train()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def step(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets=targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_one_window_spanning_the_solve_is_todays_training_step(backward):
    solver = {"backward": backward, "backward_tol": 1e-9, "backward_max_iter": 80}
    tokens, targets = batch()
    ref_loss, ref_grads = step(build(0, solver=solver), tokens, targets)
    model = build(12, solver=solver)
    loss, grads = step(model, tokens, targets)
    stats = model.solver_stats()["layers.1.looped"]
    assert 2 < stats.iterations < 12 and stats.windows == 0 and model.last_losses["windows"] == 0
    assert loss == ref_loss
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("decisions", ["sample", "token"])
def test_the_windows_forward_is_the_plain_solve(decisions):
    """Algorithm 1's state (damping, patience, best residual) goes on from window to window: with a core
    scaled until its iteration stagnates, windows of 3 take the plain solve's iterations, dampings and
    stop (per sample the eta_min stop; per token, where each token retires on its own, the cap), and
    the final window's loss is the plain training loss."""
    tokens, targets = batch()
    solver = {"max_iter": 40, "decisions": decisions}
    models = []
    for window in (0, 3):
        models.append(build(window, solver=solver))
        with torch.no_grad():
            for name in ("w_o", "w_down", "w_qkv"):
                getattr(models[-1].layers[1], name).mul_(10)
    plain, model = models
    ref_loss = plain(tokens, targets=targets).detach()
    ref = plain.solver_stats()["layers.1.looped"]
    model(tokens, targets=targets)
    stats = model.solver_stats()["layers.1.looped"]
    stop = "eta_min" if decisions == "sample" else ref.stopped_by
    assert (stats.iterations, stats.stopped_by) == (ref.iterations, stop) and 9 < ref.iterations <= 40
    assert stats.windows == (ref.iterations - 1) // 3 == model.last_losses["windows"]
    torch.testing.assert_close(model.last_losses["ce"], ref_loss, rtol=0, atol=0)
    torch.testing.assert_close(stats.final_eta, ref.final_eta, rtol=0, atol=0)


def reference_tbptt(model, tokens, targets, K: int, n: int, eta: float, k_final: int) -> torch.Tensor:
    """Truncated BPTT by hand, float64: the core's damped map F, n iterations from 0 (no stop rule can
    fire), a loss after each window of K the solve goes on after, the state detached; the final window:
    k_final differentiable steps from the detached last iterate. Returns the summed loss."""
    prelude, core, coda = model.layers
    x = prelude(model.embed(tokens), 0, None)
    conv = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), core.conv_w,
                                      groups=D).transpose(1, 2)
    cos, sin = rope_span(core.head_dim, 0, T, core.rope_theta, x)
    _, _, a2, b2 = core.scalings()

    def F(z):
        return core.one_pass(a2 * z + b2 * (x + conv), cos, sin, None)

    def decode(z):
        logits = model.norm(coda(z, 0, None)) @ model.embed.weight.T
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    z, total, done = torch.zeros_like(x), 0.0, 0
    while done + K < n:                               # a window the solver goes on after: supervised
        z = z.detach()
        for _ in range(K):
            z = eta * F(z) + (1 - eta) * z
        total = total + decode(z)
        done += K
    with torch.no_grad():                              # the window the cap ends: not supervised alone
        for _ in range(n - done):
            z = eta * F(z) + (1 - eta) * z
    z = z.detach()
    for _ in range(k_final):                           # the final window: phantom k from z*
        z = F(z)
    return total + decode(z)


@pytest.mark.parametrize("K", [1, 3])
def test_k_windows_give_the_truncated_bptt_gradient(K):
    """tol 0 (no stop before the cap of 7) and a fixed damping 0.7: windows [K]... then the final window."""
    solver = {"tol": 0.0, "max_iter": 7, "patience": 0, "damping": 0.7, "eta_min": 0.0}
    tokens, targets = batch()
    model = build(K, solver=solver)
    loss, grads = step(model, tokens, targets)
    assert model.last_losses["windows"] == len(range(K, 7, K))
    ref = build(K, solver=solver)
    ref.zero_grad(set_to_none=True)
    want = reference_tbptt(ref, tokens, targets, K, 7, 0.7, 2)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-13, msg=name)
    # and they are not the gradient without the windows
    _, plain = step(build(0, solver=solver), tokens, targets)
    assert not torch.allclose(plain["layers.1.w_qkv"], grads["layers.1.w_qkv"])


def test_bf16_takes_the_windows_and_iterations_of_fp32():
    """tiny_looped with windows of 2 under autocast bf16 beside fp32: per batch, the same stop reason,
    iterations within 1.25x and windows within one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = fpscale.load_config(os.path.join(ROOT, "configs", "tiny_looped.yaml"),
                                  ["model.layers.1.deep_supervision.window=2", "model.d_model=64",
                                   "model.max_seq_len=32", "data.seq_len=32", "model.iteration_cap.dist=none"])
    torch.manual_seed(cfg.seed)
    model = fpscale.build_model(cfg).train()
    seen = {}
    for bf16 in (False, True):
        rows = []
        for tokens in token_batches(cfg.model.vocab_size, n=2, batch=4, seq=33):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                model(tokens[:, :-1], targets=tokens[:, 1:])
            st = model.solver_stats()["layers.1.looped"]
            rows.append((st.iterations, st.stopped_by, st.windows))
        seen[bf16] = rows
    for (i32, why32, w32), (i16, why16, w16) in zip(seen[False], seen[True]):
        assert why32 == why16 != "max_iter" and max(i32, i16) <= 1.25 * min(i32, i16) and abs(w32 - w16) <= 1, seen
    assert any(w > 0 for _, _, w in seen[False]), seen


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.layers.1.deep_supervision.window.*>= 0"):
        build(-1)
    with pytest.raises(ConfigError, match=r"model.layers.1.solver.adjoint.backward.*unroll"):
        build(2, solver={"backward": "unroll"})
    with pytest.raises(ConfigError, match=r"model.layers.1.solver.forward.anderson"):
        build(2, solver={"anderson": 2})
    with pytest.raises(ConfigError, match=r"model.layers.2.deep_supervision.window.*model.layers.1"):
        fpscale.load_config(None, ["model.layers=[{type: attn}, {type: looped, deep_supervision: {window: 2}}, "
                                   "{type: looped, deep_supervision: {window: 2}}]"])


def test_zero3_over_several_dp_ranks_needs_the_stop_agreed_over_dp():
    """Each window gathers the coda's parameters over DP under ZeRO-3: the Trainer refuses rank-wise stops."""
    from fpscale.train.build import check_deep_supervision
    over = ["model.layers=[{type: attn}, {type: looped, deep_supervision: {window: 2}}, {type: attn}]",
            "parallel.zero_stage=3"]
    cfg = fpscale.load_config(None, over)
    check_deep_supervision(cfg, 1)                      # one DP rank: nothing to agree
    with pytest.raises(ConfigError, match=r"solver.forward.agree.*must be dp.*ZeRO-3 with 2 data-parallel ranks"):
        check_deep_supervision(cfg, 2)
    check_deep_supervision(fpscale.load_config(None, over + ["solver.forward.agree=dp"]), 2)
    check_deep_supervision(fpscale.load_config(None, over[:1] + ["parallel.zero_stage=2"]), 2)
