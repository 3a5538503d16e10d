"""The typed config: YAML + overrides, and errors that name the key."""
import pytest

import fpscale
from fpscale import ConfigError
from fpscale.config import config_to_dict


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
    ("solver:\n  max_iters: 3\n", [], "'solver.max_iters': unknown key for SolverConfig (did you mean 'solver.max_iter'?)"),
    ("", ["solver.damping=0"], "'solver.damping': must lie in (0, 1]"),
    ("", ["solver.max_iter=many"], "'solver.max_iter': expected an integer, got 'many'"),
    ("", ["solver.freeze_converged=1"], "'solver.freeze_converged': expected true or false"),
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
