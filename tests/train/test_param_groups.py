"""Weight decay: matrices are decayed; norms, biases, scalars and embeddings are not."""
import os

import fpscale
from fpscale.train.trainer import param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_weight_decay_reaches_matrices_only():
    model = fpscale.build_model(fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml")))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed | kept == set(names.values()) and not decayed & kept
    for matrix in ("layers.0.attn.w_qkv", "layers.0.mlp.w_down", "layers.1.attn.w_q", "layers.2.mixer.w_in",
                   "layers.3.w_qkv", "layers.3.w_gate", "layers.4.attn.w_o"):
        assert matrix in decayed, matrix
    for name in ("embed.weight",                                           # embedding
                 "norm.weight", "layers.0.norm1.weight", "layers.2.mixer.out_norm_w",   # norms
                 "layers.3.attn_norm", "layers.3.mlp_norm",              # the looped core's (stacked) norms
                 "layers.2.mixer.conv_b", "layers.2.mixer.dt_bias",      # biases
                 "layers.1.attn.log_temp", "layers.3.a1_logit",          # scalars
                 "layers.2.mixer.A_log"):                                # marked, as in mamba_ssm
        assert name in kept, name


def test_a_tensor_parallel_slice_keeps_its_no_decay_mark():
    """parallelize replaces a split parameter by its slice: FP-Mamba's A_log stays undecayed under TP."""
    from fpscale.parallel.parallelize import parallelize
    from fpscale.parallel.state import ParallelState
    model = parallelize(fpscale.build_model(fpscale.load_config(os.path.join(ROOT, "configs/tiny_mixed.yaml"))),
                        ParallelState(tp_size=2))
    _, no_decay = param_groups(model, 0.1)
    assert any(p is model.layers[2].mixer.A_log for p in no_decay["params"])
