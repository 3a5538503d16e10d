"""Every shipped config loads, validates and builds (real-size ones on the meta device)."""
import glob
import os

import pytest
import torch

import fpscale

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_builds(path):
    cfg = fpscale.load_config(path)
    with torch.device("meta"):
        model = fpscale.build_model(cfg)
    n = model.num_params()
    name = os.path.basename(path)
    if name.startswith("tiny"):
        assert n < 5e6
        assert {s.type for s in cfg.model.layers} >= ({"attn", "fpsa", "fpmamba", "looped"}
                                                       if "mixed" in name else set())
    elif name.startswith("125m"):
        assert 1.0e8 < n < 1.5e8 and cfg.data.seq_len == 2048
    else:
        assert 3.0e8 < n < 4.5e8 and cfg.data.seq_len == 2048


def test_model_config_errors_name_the_key():
    with pytest.raises(fpscale.ConfigError, match=r"model.n_heads': must divide d_model: 100 % 3"):
        fpscale.load_config(None, ["model.d_model=100", "model.n_heads=3"])
    with pytest.raises(fpscale.ConfigError, match=r"model.layers.0.type': must be one of"):
        fpscale.load_config(None, ["model.layers.0.type=mlp"])
    with pytest.raises(fpscale.ConfigError, match=r"model.layers.0.solver.max_iter': must be >= 1"):
        fpscale.load_config(None, ["model.layers.0.solver.max_iter=0"])
    with pytest.raises(fpscale.ConfigError, match=r"data.seq_len': must not exceed model.max_seq_len"):
        fpscale.load_config(None, ["data.seq_len=4096"])
    with pytest.raises(fpscale.ConfigError, match=r"train.global_batch': must be micro_batch x grad_accum"):
        fpscale.load_config(None, ["train.micro_batch=3", "train.global_batch=8"])


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_follow_the_seeds_and_load_without_a_warning(path):
    """The seeds' live quantile stop (p = 0.25: 75% of the micro-batch converged), an evaluation
    cap above the training cap, tolerances that the run's precision resolves: nothing to warn about."""
    import warnings
    from fpscale.errors import ConfigWarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = fpscale.load_config(path)
    assert [str(w.message) for w in seen if issubclass(w.category, ConfigWarning)] == []
    for i, spec in enumerate(cfg.model.layers):
        if spec.type == "attn":
            continue
        solver = cfg.solver.with_overrides(spec.solver, f"model.layers.{i}.solver")
        assert solver.stop_quantile == 0.25 and int(solver.stop_quantile * cfg.train.micro_batch) >= 1
        assert solver.eval_iterations >= 2 * solver.max_iter
