"""Selective activation checkpointing (``model.checkpoint``: none | mlp | block).

Recomputing a region in backward must change nothing but memory: with dropout on (residual and
attention, so the recomputation must draw the forward's masks, the tensor-parallel stream's too),
loss and every gradient equal those of ``none`` bit for bit. The bytes a block saves for backward
fall by what the recomputed region saved, less its input, which the checkpoint keeps.
"""
import functools

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.layers import checkpointing
from fpscale.layers.common import Unsharded, swiglu_hidden
from fpscale.parallel.random import RNGTracker
from fpscale.profiling import count_saved_bytes

D, B, T, VOCAB = 64, 2, 16, 32
DROPOUT = ["model.dropout=0.2", "model.attn_dropout=0.2"]
MIXED = ("model.layers=[{type: attn}, {type: fpsa}, {type: fpmamba, mlp: true, d_state: 4}, "
         "{type: looped, core_blocks: 1}, {type: attn}]")


def config(layers: str, *overrides: str):
    return fpscale.load_config(None, [layers, f"model.d_model={D}", f"model.vocab_size={VOCAB}", "model.max_seq_len=32",
                                      "data.seq_len=16", "solver.stop_quantile=0.0", "solver.max_iter=8", *DROPOUT,
                                      *overrides])


class TrackerShards(Unsharded):
    """One shard of a TP region of size 1: draws in ``rng()`` come from a tracker's stream, as
    under fpscale.parallel (TensorParallelShards), with no collective."""

    def __init__(self, tracker):
        self.tracker = tracker

    def rng(self):
        return self.tracker.fork()


def with_tracker(model, seed: int = 5):
    tracker = RNGTracker()
    tracker.add("tensor-parallel", seed)
    for m in model.modules():
        if isinstance(getattr(m, "shards", None), Unsharded):
            m.shards = TrackerShards(tracker)
    return model


def run(cfg, tracker: bool = False, steps: int = 2):
    """Losses and gradients of ``steps`` training forwards + backwards from seed 0 (the masks
    differ between the steps: the default stream and the tracker move on)."""
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).train()
    if tracker:
        with_tracker(model)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens, targets = (torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(2))
        loss = model(tokens, targets=targets)
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=None)
def without_checkpointing(layers: str, tracker: bool = False):
    """``run`` of ``layers`` with ``model.checkpoint`` none: the reference of both modes, computed once
    (read only: assert_same compares, nothing changes it)."""
    return run(config(layers), tracker=tracker)


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert la == lb
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), (n, (ga[n] - gb[n]).abs().max().item())


@pytest.mark.parametrize("layers", ["model.layers=[{type: attn, repeat: 2}]", MIXED], ids=["attn", "mixed"])
@pytest.mark.parametrize("mode", ["mlp", "block"])
def test_checkpointing_changes_no_loss_and_no_gradient(layers, mode):
    assert_same(run(config(layers, f"model.checkpoint={mode}")), without_checkpointing(layers))


@pytest.mark.parametrize("mode", ["mlp", "block"])
def test_recomputation_draws_the_tp_streams_masks(mode, monkeypatch):
    """Attention dropout draws from the tensor-parallel tracker's stream: the recomputation in
    backward draws the forward's mask from it. Without restoring the stream (the tracker found
    nowhere) the block would recompute with another mask and its gradients would differ."""
    layers = "model.layers=[{type: attn, repeat: 2}]"
    reference = without_checkpointing(layers, tracker=True)
    assert_same(run(config(layers, f"model.checkpoint={mode}"), tracker=True), reference)
    if mode == "block":
        monkeypatch.setattr(checkpointing, "_trackers", lambda modules: [])
        losses, grads = run(config(layers, "model.checkpoint=block"), tracker=True)
        assert losses[0] == reference[0][0]                # the forward is the same, not so the backward
        assert not torch.equal(grads["layers.0.attn.w_qkv"], reference[1]["layers.0.attn.w_qkv"])


def test_per_layer_checkpoint_overrides_the_global_one():
    cfg = config("model.layers=[{type: attn, checkpoint: none}, {type: attn, repeat: 2}, "
                 "{type: fpsa, checkpoint: mlp}]", "model.checkpoint=block")
    model = fpscale.build_model(cfg)
    assert [layer.checkpoint for layer in model.layers] == ["none", "block", "block", "mlp"]
    cfg = config("model.layers=[{type: attn}, {type: attn}]", "model.layers.1.checkpoint=mlp")
    assert [layer.checkpoint for layer in fpscale.build_model(cfg).layers] == ["none", "mlp"]


@pytest.mark.parametrize("override,key", [
    ("model.checkpoint=full", "model.checkpoint"),
    ("model.checkpoint=true", "model.checkpoint"),
    ("model.layers.0.checkpoint=attention", "model.layers.0.checkpoint"),
])
def test_a_bad_mode_names_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"{key}': (must be one of none, mlp, block|expected a string)"):
        config("model.layers=[{type: attn}]", override)


def saved_bytes(block, x, **kw):
    with count_saved_bytes(tuple(block.parameters())) as counter:
        block(x, **kw)
    return counter.total


def blocks(layer: str):
    """The first block of a one-layer model, per mode, same weights."""
    out = {}
    for mode in ("none", "mlp", "block"):
        torch.manual_seed(0)
        out[mode] = fpscale.build_model(config(f"model.layers=[{layer}]", f"model.checkpoint={mode}")).train().layers[0]
    return out


def test_saved_bytes_of_an_attn_block():
    """fp32, [B, T, d] input, SwiGLU hidden H:
      block  keeps the block input only: 4 B T d bytes
      mlp    keeps the attention sublayer's activations and the MLP sublayer's input (4 B T d):
             less than none by what the MLP sublayer saves (norm, gate / up / silu / product: at
             least 4 x 4 B T H, the dropout mask) minus its input"""
    x = torch.randn(B, T, D, requires_grad=True)
    by_mode = {mode: saved_bytes(block, x) for mode, block in blocks("{type: attn}").items()}
    block = blocks("{type: attn}")["none"]
    x_mid = block.attn_sublayer(x).detach().requires_grad_()
    with count_saved_bytes(tuple(block.parameters())) as mlp_part:
        block.mlp_sublayer(x_mid)
    hidden = swiglu_hidden(D, 8 / 3)
    assert by_mode["block"] == 4 * B * T * D
    assert mlp_part.total >= 4 * 4 * B * T * hidden + 4 * B * T * D
    assert by_mode["none"] - by_mode["mlp"] == mlp_part.total - 4 * B * T * D
    assert by_mode["mlp"] > by_mode["block"]


@pytest.mark.parametrize("layer", ["{type: fpsa}", "{type: fpmamba, mlp: true, d_state: 4}"])
def test_a_looped_block_recomputes_its_mlp_only(layer):
    """fpsa and fpmamba (with its MLP): ``block`` is ``mlp`` (the solve is not recomputed: its
    own backward keeps what it needs), both save less than none by the MLP sublayer, less its input."""
    x = torch.randn(B, T, D, requires_grad=True)
    by_mode = {mode: saved_bytes(block, x) for mode, block in blocks(layer).items()}
    assert by_mode["block"] == by_mode["mlp"]
    hidden = swiglu_hidden(D, 8 / 3)
    assert by_mode["none"] - by_mode["mlp"] >= 4 * 4 * B * T * hidden


def test_no_recomputation_without_grad_or_with_a_cache():
    """Evaluation (no grad) and decoding (a cache) run the block as it is."""
    block = blocks("{type: attn}")["block"].eval()
    calls = []
    block.mlp.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(1, 4, D)
    with torch.no_grad():
        block(x)
    block(x, cache={})
    assert len(calls) == 2
