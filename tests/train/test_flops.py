"""The FLOP model: every layer type's declared FLOPs against torch's FLOP counter; executed FLOPs
follow the iterations actually taken and the backward mode's cost."""
import pytest
import torch

import fpscale
from fpscale.models import ModelConfig, layer_spec
from fpscale.train.flops import layer_flops, peak_tflops, training_flops

COUNTED = [("attn", {}), ("fpsa", {}), ("looped", {}), ("looped", {"core_blocks": 1, "conv": True}),
           ("fpmamba", {}), ("fpmamba", {"mixer": "dplr", "y_feedback": False}), ("fpmamba", {"mixer": "kronecker"}),
           ("fpmamba", {"mixer": "none", "mlp": True}), ("damped_mlp", {}),
           ("fpmamba", {"preset": "authors_state_tracking", "mixer": "kronecker"}),
           ("fpmamba", {"preset": "authors_lm"}), ("attn", {"mlp": "relu2", "qk_norm": True, "value_embed": True}),
           ("attractor", {}), ("attractor", {"head_blocks": 2, "mlp": "swiglu"})]


@pytest.mark.parametrize("kind,spec", COUNTED, ids=[f"{k}-{'-'.join(map(str, s.values()))}" for k, s in COUNTED])
def test_layer_flops_match_torch_flop_counter(kind, spec):
    """Each layer type's declared FLOPs against torch.utils.flop_counter on one forward that runs
    exactly 3 solver iterations. The counter sees matrix products (mm, bmm, convolution) only, so
    the two terms that are not one are taken out by name: the attention scores (CPU attention
    runs a fused kernel the counter does not count) and FP-Mamba's elementwise scan update (its
    read C^T h is a batched product, which the counter sees)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fpscale.layers.common import attention_score_flops
    from fpscale.layers.fpmamba_map import scan_flops, scan_read_flops
    from tests.layers import damped_mlp  # noqa: F401  (registers the type)
    from tests.models.helpers import tiny_config

    B, T, d, k = 2, 32, 64, 3
    cfg = tiny_config(kind, d=d, solver={"tol": 0.0, "max_iter": k, "eval_max_iter": k, "anderson": 0}, **spec)
    model = fpscale.build_model(cfg).eval()
    for m in model.token_readers:             # value embeddings read the token ids (LoopedLM.hidden sets them)
        m.tokens = torch.zeros(B, T, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.layers[0](torch.randn(B, T, d))
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.bmm", "aten.convolution"}, ops
    layer = cfg.model.layers[0]
    static, per_iter = layer.flops(cfg.model, T)
    iterations = {"attn": 1}.get(kind, k)
    if kind != "attn":
        assert [s.iterations for s in model.solver_stats().values()] == [k]
    declared = static + per_iter * iterations if per_iter else static
    score_passes = {"attn": 1, "fpsa": k, "looped": k * getattr(layer, "core_blocks", 0),
                    "attractor": k * getattr(layer, "head_blocks", 0)}.get(kind, 0)
    not_counted = score_passes * attention_score_flops(d, T)
    if kind == "fpmamba":
        di = layer.expand * d
        not_counted += k * (scan_flops(di, layer.d_state) - scan_read_flops(di, layer.d_state))
    assert sum(ops.values()) / (B * T) == pytest.approx(declared - not_counted, rel=1e-9)


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


@pytest.mark.parametrize("name, precision, tf32, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),          # SXM
    ("NVIDIA H100 PCIe", "bf16", False, 756.0),               # not the SXM part's 989
    ("NVIDIA H100 NVL", "bf16", False, 835.5),
    ("NVIDIA H200", "bf16", False, 989.4),
    ("NVIDIA H200 NVL", "bf16", False, 835.5),
    ("NVIDIA GH200 480GB", "bf16", False, 989.4),
    ("NVIDIA A100-SXM4-40GB", "bf16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "bf16", False, 312.0),
    ("NVIDIA B200", "bf16", False, 2250.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),           # fp32 matmuls on TF32 tensor cores
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
])
def test_peak_by_exact_device(name, precision, tf32, peak):
    assert peak_tflops(name, precision, 0, tf32) == peak


def test_an_unknown_device_has_no_peak_unless_configured():
    assert peak_tflops("cpu", "fp32", 0) is None and peak_tflops("cpu", "fp32", 0.1) == 0.1
    assert peak_tflops("NVIDIA L40S", "bf16", 0) is None                     # no MFU against a neighbour's peak
    assert peak_tflops("NVIDIA H100 PCIe", "bf16", 700.0) == 700.0           # train.peak_tflops wins


@pytest.mark.parametrize("attention", ["hqsa", "causal"])
def test_epsilon_flops_match_torch_flop_counter(attention):
    """An epsilon forward that runs exactly 3 steps (the halting heads never halt before the
    cap): the declared FLOPs against the counter; the causal variant's scores are taken out as
    for attn (a fused kernel the counter does not see), HQSA's products are all counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from fpscale.layers.common import attention_score_flops
    from tests.models.helpers import tiny_config

    B, T, d, k = 2, 32, 64, 3
    cfg = tiny_config("epsilon", d=d, attention=attention, max_steps=k, target_halting_mean=2.0)
    model = fpscale.build_model(cfg).eval()
    with torch.no_grad():
        model.layers[0].b_halt.fill_(-30.0)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.layers[0](torch.randn(B, T, d))
    assert model.layers[0].last_stats.iterations == k
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.addmm", "aten.bmm"}, ops
    static, per_iter = cfg.model.layers[0].flops(cfg.model, T)
    not_counted = k * attention_score_flops(d, T) if attention == "causal" else 0.0
    assert sum(ops.values()) / (B * T) == pytest.approx(static + k * per_iter - not_counted, rel=1e-9)


def test_deep_supervision_windows_add_their_recomputed_forward_and_backward():
    """Per supervised window of K: 3 x per_iter x K for the window, 4 x (the layers after it + the head)."""
    import fpscale
    from fpscale.train.flops import head_flops, layer_flops, training_flops
    cfg = fpscale.load_config(None, ["model.layers=[{type: attn}, {type: looped, deep_supervision: {window: 3}}, "
                                     "{type: attn}]"]).model
    per = layer_flops(cfg, 64)
    stats = [None, {"iterations": 7.0, "backward_iterations": 0.0, "windows": 0.0, "window": 3}, None]
    modes, ks = ["-", "phantom", "-"], [1, 2, 1]
    _, plain = training_flops(cfg, 64, stats, modes, ks)
    _, two = training_flops(cfg, 64, [None, {**stats[1], "windows": 2.0}, None], modes, ks)
    assert two - plain == pytest.approx(2 * (3 * per[1][1] * 3 + 4 * (per[2][0] + head_flops(cfg))))
