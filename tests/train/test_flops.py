"""The FLOP model: a hand count for attention; executed FLOPs follow the iterations actually
taken and the backward mode's cost."""
import pytest

from fpscale.models import ModelConfig, layer_spec
from fpscale.models.common import swiglu_hidden
from fpscale.train.flops import layer_flops, peak_tflops, training_flops


def test_attention_block_matches_a_hand_count():
    cfg = ModelConfig(vocab_size=100, d_model=64, n_heads=4, layers=[layer_spec("attn")])
    ((static, per_iter),) = layer_flops(cfg, seq_len=32)
    h = swiglu_hidden(64, cfg.mlp_ratio)
    assert static == 2 * 64 * 192 + 2 * 64 * 64 + 4 * 16 * 64 + 6 * 64 * h and per_iter == 0


@pytest.mark.parametrize("kind", ["fpsa", "fpmamba", "looped"])
def test_executed_flops(kind):
    cfg = ModelConfig(vocab_size=100, d_model=64, n_heads=4, layers=[layer_spec(kind)])
    (static, per_iter), = layer_flops(cfg, 32)
    assert per_iter > 0
    one = training_flops(cfg, 32, [{"iterations": 1}], ["jfb"], [1])
    # jfb after one no-grad iteration: the nominal cost plus that iteration
    assert one[1] == pytest.approx(one[0] + per_iter)
    ten = training_flops(cfg, 32, [{"iterations": 10}], ["jfb"], [1])
    assert ten[1] - one[1] == pytest.approx(9 * per_iter)
    unroll = training_flops(cfg, 32, [{"iterations": 10}], ["unroll"], [1])
    assert unroll[1] == pytest.approx(ten[1] - 3 * per_iter + 2 * 10 * per_iter)
    implicit = training_flops(cfg, 32, [{"iterations": 10, "backward_iterations": 5}], ["implicit"], [1])
    assert implicit[1] == pytest.approx(ten[1] + 10 * per_iter)


def test_peak_lookup():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 0) == 989.0
    assert peak_tflops("cpu", "fp32", 0) is None and peak_tflops("cpu", "fp32", 0.1) == 0.1
