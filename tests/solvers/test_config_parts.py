"""The solver configuration in parts (issue 47): forward / adjoint / execution / compat, the nested form
canonical, the flat form (YAML, overrides, a layer's ``solver``, an old run's config.yaml) loading with one
ConfigDeprecation per key naming the new key.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/solvers/test_config_parts.py
"""
import dataclasses
import os
import warnings

import pytest
import yaml

import fpscale
from fpscale.config import config_from_dict, config_to_dict
from fpscale.errors import ConfigDeprecation, ConfigError
from fpscale.solvers import SolverConfig
from fpscale.solvers.config import PART_OF, PARTS, key_of
from fpscale.typed import from_dict, to_dict
from tests.parallel.launch import ROOT


def load(overrides=(), path=None):
    """The config and the deprecation messages its loading said."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = fpscale.load_config(path, list(overrides))
    return cfg, [str(w.message) for w in seen if issubclass(w.category, ConfigDeprecation)]


def test_one_table_places_every_field_in_exactly_one_part():
    names = [f.name for cls in PARTS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(PART_OF) == 33
    assert (PART_OF["tol"], PART_OF["backward"], PART_OF["chunk"], PART_OF["stop_residual"]) == \
        ("forward", "adjoint", "execution", "compat")
    assert key_of("anderson_variant", "solver") == "solver.compat.anderson_variant"
    for cls in PARTS.values():                    # each part's docstring documents each of its fields
        for f in dataclasses.fields(cls):
            assert f" {f.name}" in cls.__doc__, (cls.__name__, f.name)


def test_flat_keywords_place_themselves_and_replace_works():
    cfg = SolverConfig(tol=1e-3, chunk=4, backward="jfb", stop_residual="best")
    assert (cfg.forward.tol, cfg.execution.chunk, cfg.adjoint.backward, cfg.compat.stop_residual) == \
        (1e-3, 4, "jfb", "best")
    assert (cfg.tol, cfg.chunk, cfg.backward, cfg.stop_residual) == (1e-3, 4, "jfb", "best")
    other = dataclasses.replace(cfg, tol=5e-2, cuda_graph=True)
    assert (other.tol, other.chunk, other.cuda_graph, cfg.tol, cfg.cuda_graph) == (5e-2, 4, True, 1e-3, False)
    assert other.forward is not cfg.forward                 # a copy: changing one never changes the other
    other.forward.max_iter = 3
    assert cfg.max_iter == 30 and other.max_iter == 3
    assert SolverConfig(forward=cfg.forward, patience=2).forward.tol == 1e-3
    with pytest.raises(AttributeError):
        cfg.tol = 1.0                                        # type: ignore[misc]   read-only: write cfg.forward.tol
    with pytest.raises(TypeError, match="unexpected keyword argument.*tl"):
        SolverConfig(tl=1.0)


def test_to_dict_writes_the_nested_form_and_round_trips():
    cfg = SolverConfig(tol=1e-3, chunk=4, backward="phantom", anderson=3, anderson_variant="attractor",
                       decisions="sample")
    data = to_dict(cfg)
    assert list(data) == ["forward", "adjoint", "execution", "compat"] and data["execution"]["chunk"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # the nested form loads quietly
        assert from_dict(SolverConfig, data, "solver") == cfg
        whole = fpscale.load_config(os.path.join(ROOT, "configs", "tiny_mixed.yaml"))
        assert config_from_dict(config_to_dict(whole)) == whole


NESTED = {"forward": {"max_iter": 16, "tol": 2.0e-2}, "adjoint": {"backward": "implicit"}, "execution": {"chunk": 4}}
FLAT = {"max_iter": 16, "tol": 2.0e-2, "backward": "implicit", "chunk": 4}


def test_a_flat_yaml_loads_to_its_nested_form_warning_once_per_key_naming_the_new_key(tmp_path):
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump({"solver": FLAT}))
    (tmp_path / "nested.yaml").write_text(yaml.safe_dump({"solver": NESTED}))
    flat, said = load(path=str(tmp_path / "flat.yaml"))
    nested, quiet = load(path=str(tmp_path / "nested.yaml"))
    assert flat == nested and quiet == []
    assert sorted(said) == sorted(f"config key 'solver.{k}' is now '{key_of(k, 'solver')}': the flat key loads, "
                                  f"the nested one is the form to write" for k in FLAT)


@pytest.mark.parametrize("flat,nested", [
    ("solver.tol=1e-4", "solver.forward.tol=1e-4"),
    ("solver.chunk=4", "solver.execution.chunk=4"),
    ("model.layers.1.solver.tol=0.3", "model.layers.1.solver.forward.tol=0.3"),
    ("model.layers.1.solver={tol: 0.3, backward: jfb}",
     "model.layers.1.solver={forward: {tol: 0.3}, adjoint: {backward: jfb}}"),
])
def test_a_flat_override_equals_its_nested_form(flat, nested):
    base = ["model.layers=[{type: attn}, {type: fpsa}]"]
    a, said = load(base + [flat])
    b, quiet = load(base + [nested])
    assert a == b and quiet == [] and len(said) == flat.count(":") + (":" not in flat)
    assert all("is now 'model.layers.1.solver." in m or "is now 'solver." in m for m in said)


def test_the_later_word_wins_whatever_its_form(tmp_path):
    (tmp_path / "flat.yaml").write_text("solver: {tol: 0.5}\n")
    (tmp_path / "nested.yaml").write_text("solver: {forward: {tol: 0.5}}\n")
    assert load(["solver.forward.tol=0.25"], str(tmp_path / "flat.yaml"))[0].solver.tol == 0.25
    assert load(["solver.tol=0.25"], str(tmp_path / "nested.yaml"))[0].solver.tol == 0.25
    assert load(["solver.tol=0.25", "solver.forward.tol=0.125"])[0].solver.tol == 0.125
    assert load(["solver.forward.tol=0.125", "solver.tol=0.25"])[0].solver.tol == 0.25


@pytest.mark.parametrize("override,needle", [
    ("solver.forward.chunk=4", "'solver.forward.chunk': belongs to execution: write 'solver.execution.chunk'"),
    ("solver.forward.tl=0.1",
     "'solver.forward.tl': unknown key for ForwardConfig (did you mean 'solver.forward.tol'?)"),
    ("solver.tl=0.1", "'solver.tl': unknown key for SolverConfig (did you mean 'solver.forward.tol'?)"),
    ("solver.adjoint=3", "'solver.adjoint': expected a mapping of AdjointConfig fields"),
    ("model.layers.1.solver.adjoint.tol=0.1",
     "'model.layers.1.solver.adjoint.tol': belongs to forward: write 'model.layers.1.solver.forward.tol'"),
    ("model.layers.1.solver.execution.chunks=2",
     "'model.layers.1.solver.execution.chunks': unknown key for ExecutionConfig (did you mean "
     "'model.layers.1.solver.execution.chunk'?)"),
    ("model.layers.1.solver.tl=0.1", "'model.layers.1.solver.tl': unknown key for SolverConfig"),
])
def test_a_key_in_the_wrong_part_or_misspelt_is_refused_naming_it(override, needle):
    with pytest.raises(ConfigError) as info:
        load(["model.layers=[{type: attn}, {type: fpsa}]", override])
    assert needle in str(info.value)


def test_an_old_runs_flat_config_yaml_still_loads_for_resume_and_evaluate(tmp_path):
    """A run saved before the parts wrote its solver flat, in the section and in each layer: the checkpoint
    loader's ``from_dict(Config, ...)`` (resume, evaluate, convert) and ``load_config`` read it as the
    nested config it means, naming each moved key once."""
    cfg = fpscale.load_config(os.path.join(ROOT, "configs", "tiny_mixed.yaml"))
    old = config_to_dict(cfg)
    old["solver"] = {k: v for part in old["solver"].values() for k, v in part.items()}
    for spec in old["model"]["layers"]:
        if "solver" in spec:
            spec["solver"] = {k: v for part in spec["solver"].values() for k, v in part.items()}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    for read in (lambda: fpscale.load_config(str(path)),
                 lambda: from_dict(fpscale.Config, yaml.safe_load(path.read_text()))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            again = read()
        said = [str(w.message) for w in seen if issubclass(w.category, ConfigDeprecation)]
        assert again == cfg
        assert len(said) == len(set(said)) == 33 + 4 + 4 + 2   # the section's 33 keys, the looped layers' 4, 4 and 2
        assert "config key 'model.layers.1.solver.backward_tol' is now 'model.layers.1.solver.adjoint." \
               "backward_tol'" in " ".join(said)


def test_layer_overrides_merge_flat_or_nested_keys_into_the_parts():
    base = SolverConfig(tol=1e-2, backward="implicit", chunk=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # code's own overrides: no deprecation
        a = base.with_overrides({"forward": {"patience": 2}, "tol": 0.1, "chunk_schedule": "expected"}, "s")
    assert (a.tol, a.patience, a.chunk, a.chunk_schedule, a.backward) == (0.1, 2, 2, "expected", "implicit")
    with pytest.raises(ConfigError, match=r"'model.layers.3.solver.forward.damping': must lie in \(0, 1\]"):
        base.with_overrides({"damping": 2.0}, "model.layers.3.solver")


# every cross-field and range rule, the key it names (SolverConfig.validate's table)
RULES = [
    ({"max_iter": 0}, "forward.max_iter"), ({"eval_max_iter": -1}, "forward.eval_max_iter"),
    ({"tol": float("nan")}, "forward.tol"), ({"backward_tol": -1.0}, "adjoint.backward_tol"),
    ({"eps": float("inf")}, "forward.eps"), ({"anderson_lambda": -1.0}, "forward.anderson_lambda"),
    ({"eta_min": -1.0}, "forward.eta_min"), ({"stop_quantile": 1.0}, "forward.stop_quantile"),
    ({"damping": 0.0}, "forward.damping"), ({"patience": -1}, "forward.patience"), ({"decay": 1.0}, "forward.decay"),
    ({"eta_min": 0.5, "damping": 0.5}, "forward.eta_min"), ({"decisions": "unit"}, "forward.decisions"),
    ({"anderson": 1}, "forward.anderson"), ({"check_every": 0}, "execution.check_every"),
    ({"bookkeeping": "x"}, "execution.bookkeeping"), ({"bookkeeping": "fused", "anderson": 3}, "execution.bookkeeping"),
    ({"min_iter": -1}, "forward.min_iter"), ({"backward_min_iter": -1}, "adjoint.backward_min_iter"),
    ({"anderson_variant": "x"}, "compat.anderson_variant"),
    ({"anderson_variant": "attractor", "decisions": "sample"}, "compat.anderson_variant"),
    ({"norm": "sample_l2"}, "forward.decisions"),
    ({"norm": "sample_l2", "decisions": "sample", "bookkeeping": "fused"}, "execution.bookkeeping"),
    ({"chunk": -1}, "execution.chunk"), ({"chunk_schedule": "x"}, "execution.chunk_schedule"),
    ({"cuda_graph": True}, "execution.cuda_graph"),
    ({"cuda_graph": True, "chunk": 2, "backward": "unroll"}, "execution.cuda_graph"),
    ({"adjoint_step": "x"}, "adjoint.adjoint_step"), ({"eval_output": "x"}, "adjoint.eval_output"),
    ({"phantom_steps": 0}, "adjoint.phantom_steps"), ({"backward_max_iter": 0}, "adjoint.backward_max_iter"),
]


@pytest.mark.parametrize("fields,key", RULES)
def test_each_rule_raises_naming_its_full_key(fields, key):
    SolverConfig().validate("solver")
    with pytest.raises(ConfigError) as info:
        SolverConfig(**fields).validate("model.layers.2.solver")
    assert info.value.key == f"model.layers.2.solver.{key}"
