"""The typed config: YAML + overrides, and errors that name the key."""
import warnings

import pytest
import torch

import fpscale
from fpscale import ConfigError
from fpscale.config import config_to_dict
from fpscale.errors import ConfigWarning


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "name: demo\nsolver:\n  max_iter: 12\n  backward: phantom\n")
    cfg = fpscale.load_config(path, overrides=["solver.tol=1e-4", "solver.freeze_converged=true", "seed=7"])
    assert cfg.name == "demo" and cfg.seed == 7
    assert cfg.solver.max_iter == 12 and cfg.solver.backward == "phantom"
    assert cfg.solver.tol == 1e-4 and cfg.solver.freeze_converged is True
    # round trip through a plain dict
    again = fpscale.config.config_from_dict(config_to_dict(cfg))
    assert again == cfg


@pytest.mark.parametrize("text,overrides,needle", [
    ("solver:\n  max_iters: 3\n", [],
     "'solver.max_iters': unknown key for SolverConfig (did you mean 'solver.forward.max_iter'?)"),
    ("", ["solver.damping=0"], "'solver.forward.damping': must lie in (0, 1]"),
    ("", ["solver.max_iter=many"], "'solver.forward.max_iter': expected an integer, got 'many'"),
    ("", ["solver.freeze_converged=1"], "'solver.forward.freeze_converged': expected true or false"),
    ("", ["solver"], "an override must look like key.sub=value"),
    ("seed: 5\n", ["seed.value=3"], "'seed': is a value (5), it has no sub-keys"),
    ("solver: 3\n", [], "'solver': expected a mapping of SolverConfig fields"),
    ("- a\n- b\n", [], "must hold a mapping at the top level"),
    ("name: a/b\n", [], "'name': must be a non-empty run name"),
])
def test_errors_name_the_key(tmp_path, text, overrides, needle):
    with pytest.raises(ConfigError) as info:
        fpscale.load_config(write(tmp_path, text), overrides)
    assert needle in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        fpscale.load_config(str(tmp_path / "nope.yaml"))


def config_warnings(overrides, path=None):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = fpscale.load_config(path, overrides)
    return cfg, [str(w.message) for w in seen if issubclass(w.category, ConfigWarning)]


LOOPED = ["model.layers.0.type=fpsa"]


@pytest.mark.parametrize("overrides,key", [
    (["solver.stop_quantile=0.1", "train.micro_batch=8"], "solver.forward.stop_quantile"),
    (["solver.stop_quantile=0.25", "train.micro_batch=2", "train.global_batch=8"], "solver.forward.stop_quantile"),
    (["model.layers.0.solver={stop_quantile: 0.1}", "train.micro_batch=4"],
     "model.layers.0.solver.forward.stop_quantile"),
])
def test_an_inert_stop_quantile_warns_naming_the_key(overrides, key):
    """p * micro_batch < 1 tolerates no unconverged sample: the rule is p = 0 in disguise."""
    _, seen = config_warnings(LOOPED + overrides)
    assert len(seen) == 1 and seen[0].startswith(f"config key '{key}'") and "the same as 0" in seen[0]


@pytest.mark.parametrize("overrides", [["solver.stop_quantile=0.25", "train.micro_batch=4"],
                                       ["solver.stop_quantile=0.0", "train.micro_batch=1"],
                                       ["solver.stop_quantile=0.1", "train.micro_batch=2"]])
def test_a_live_or_zero_stop_quantile_is_quiet(overrides):
    # the last one: no looped layer (the default model is attn only), so nothing to say
    _, seen = config_warnings((LOOPED if "micro_batch=2" not in overrides[1] else []) + overrides)
    assert seen == []


def test_bf16_raises_unreachable_tolerances_to_the_floor_naming_the_key():
    from fpscale.solvers.precision import residual_floor
    floor = residual_floor(torch.bfloat16)
    base = LOOPED + ["solver.tol=1e-3", "model.layers.0.solver={backward: implicit, backward_tol: 1e-4}"]
    cfg, seen = config_warnings(base + ["train.precision=bf16"])
    assert sorted(m.split("'")[1] for m in seen) == ["model.layers.0.solver.adjoint.backward_tol", "solver.forward.tol"]
    assert all(f"raised to {floor:.3g}" in m for m in seen)
    assert cfg.solver.tol == floor and cfg.model.layers[0].solver["adjoint"]["backward_tol"] == floor
    cfg, seen = config_warnings(base)               # fp32 resolves them: untouched, quiet
    assert seen == [] and cfg.solver.tol == 1e-3


def test_eval_max_iter_defaults_to_the_training_cap():
    cfg = fpscale.load_config(None, ["solver.max_iter=7"])
    assert cfg.solver.eval_iterations == 7
    cfg = fpscale.load_config(None, ["solver.max_iter=7", "solver.eval_max_iter=64"])
    assert cfg.solver.eval_iterations == 64
    with pytest.raises(ConfigError, match=r"'solver.forward.eval_max_iter': must be >= 0"):
        fpscale.load_config(None, ["solver.eval_max_iter=-1"])


def test_the_save_timeout_grows_with_the_model():
    """A save of 1.3B parameters (21 GB at 16 bytes each) may take minutes on a shared file system:
    its waits get parallel.timeout_s plus writing and hashing at 100 MB/s, unless set."""
    from fpscale.parallel.config import ParallelConfig
    from fpscale.train.checkpoint import save_timeout_s
    assert save_timeout_s(ParallelConfig(), 2_000_000) == pytest.approx(300 + 0.64)
    assert save_timeout_s(ParallelConfig(), 1_300_000_000) == pytest.approx(300 + 416)
    assert save_timeout_s(ParallelConfig(save_timeout_s=50), 1_300_000_000) == 50
