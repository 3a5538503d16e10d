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
    elif "attractor" in name:          # jacobfa/Attractor's labels and the baselines beside them (issue 38)
        want = {"140m_attractor.yaml": 134.2e6, "140m_attractor_eqparams.yaml": 134.2e6,
                "140m_attractor_gpt.yaml": 143.1e6, "140m_attractor_eqflops.yaml": 272.7e6,
                "370m_attractor.yaml": 376.2e6, "770m_attractor.yaml": 769.5e6}[name]
        assert n == pytest.approx(want, rel=1e-3) and cfg.data.seq_len == 2048
    elif name == "125m_mamba1.yaml":   # plain Mamba-1 at the 125m geometry: no MLP, tied embeddings
        assert cfg.model.d_model == 768 and 0.8e8 < n < 0.9e8 and cfg.data.seq_len == 2048
    elif name.startswith("125m"):      # the GPT-3 125M geometry
        assert cfg.model.d_model == 768 and 1.6e8 < n < 3.0e8 and cfg.data.seq_len == 2048
    else:
        assert 3.0e8 < n < 4.5e8 and cfg.data.seq_len == 2048


def test_125m_recipes_compare_at_equal_parameters():
    """attn, fpsa and looped at the same parameters; the plain Mamba baseline within 3% of them;
    FP-Mamba is the Mamba baseline plus its channel mixer (seed 002 compares the two at identical
    hyperparameters); all on the same token budget."""
    counts, budgets = {}, set()
    for kind in ("attn", "fpsa", "looped", "mamba", "fpmamba"):
        cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", f"125m_{kind}.yaml"))
        with torch.device("meta"):
            counts[kind] = fpscale.build_model(cfg).num_params()
        budgets.add((cfg.train.steps, cfg.train.global_batch_tokens, cfg.train.lr))
    assert counts["fpsa"] == pytest.approx(counts["attn"], rel=1e-6) == counts["looped"]
    assert counts["mamba"] == pytest.approx(counts["attn"], rel=0.03)
    assert counts["fpmamba"] > counts["mamba"]
    assert budgets == {(4800, 524288, 4e-3)}


def test_the_authors_fineweb_recipes_are_their_models():
    """configs/125m_fpmamba_authors.yaml is seed 002's FineWeb FP-Mamba as dr-faustus/fp-rnn runs it
    (plainLM/config/fpmamba.yaml through construct.py and mamba_ssm's MambaConfig defaults) and
    configs/125m_mamba1.yaml its plain Mamba-1 baseline, on the same budget and optimiser."""
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    cfg = fpscale.load_config(os.path.join(root, "125m_fpmamba_authors.yaml"))
    (spec,) = cfg.model.layers
    assert (cfg.model.d_model, spec.repeat, spec.d_state, spec.expand, spec.d_conv) == (768, 12, 16, 2, 4)
    assert cfg.model.tie_embeddings and not spec.mlp                       # MambaConfig: tied, d_intermediate 0
    assert (spec.type, spec.preset, spec.mixer, spec.mixer_rank) == ("fpmamba", "authors_lm", "householder", 2)
    assert spec.negative_eigs and spec.mixer_bias_init == 0.0               # a_i = 2 sigmoid(.), 1.0 at init
    assert (spec.u_activation, spec.out_norm, spec.input_path, spec.gate) == ("silu", "layernorm", "conv_silu",
                                                                              "inside")
    assert not spec.bc_norm and not spec.y_into_delta and spec.weight_norm and spec.feedback_init == "linear"
    solver = cfg.solver.with_overrides(spec.solver, "solver")
    assert (solver.damping, solver.decay, solver.patience, solver.tol, solver.stop_quantile) == (0.99, 0.9, 15, 0.1,
                                                                                                0.25)
    assert (solver.stop_residual, solver.backward, solver.max_iter, solver.eval_max_iter) == ("best", "jfb", 100,
                                                                                             1000)
    assert solver.eta_min == 1e-3
    t = cfg.train
    assert (t.steps, t.global_batch_tokens, t.lr, t.min_lr, t.warmup, t.weight_decay, t.beta1, t.beta2,
            t.grad_clip) == (4800, 524288, 4e-3, 1e-5, 480, 0.1, 0.9, 0.95, 1.0)
    base = fpscale.load_config(os.path.join(root, "125m_mamba1.yaml"))
    (m1,) = base.model.layers
    assert base.model.tie_embeddings and not m1.mlp and m1.iterate_free and m1.repeat == 12
    assert (m1.mixer, m1.bc_norm, m1.out_norm, m1.input_path, m1.gate) == ("none", False, "none", "conv_silu",
                                                                           "inside")
    assert (base.train.steps, base.train.global_batch_tokens, base.train.lr) == (t.steps, t.global_batch_tokens, t.lr)


def test_model_config_errors_name_the_key():
    with pytest.raises(fpscale.ConfigError, match=r"model.n_heads': must divide d_model: 100 % 3"):
        fpscale.load_config(None, ["model.d_model=100", "model.n_heads=3"])
    with pytest.raises(fpscale.ConfigError, match=r"model.layers.0.type': unknown layer type 'mlp'; registered "
                                                  r"types: attn, fpsa, fpmamba, looped"):
        fpscale.load_config(None, ["model.layers.0.type=mlp"])
    with pytest.raises(fpscale.ConfigError, match=r"model.layers.0.solver.forward.max_iter': must be >= 1"):
        fpscale.load_config(None, ["model.layers=[{type: fpsa}]", "model.layers.0.solver.forward.max_iter=0"])


@pytest.mark.parametrize("entry, key", [("{type: attn, mixer: dplr}", "mixer"),      # fpmamba's key on attn
                                        ("{type: attn, solver: {tol: 0.1}}", "solver"),   # attn has no solver
                                        ("{type: fpsa, core_blocks: 2}", "core_blocks"),
                                        ("{type: looped, spectral_norm: false}", "spectral_norm")])
def test_a_key_of_another_layer_type_is_refused(entry, key):
    """Each layer type is its own config section: a key that belongs to another type names itself."""
    with pytest.raises(fpscale.ConfigError, match=rf"model.layers.0.{key}': unknown key for \w+Spec"):
        fpscale.load_config(None, [f"model.layers=[{entry}]"])
    with pytest.raises(fpscale.ConfigError, match=r"data.seq_len': must not exceed model.max_seq_len"):
        fpscale.load_config(None, ["data.seq_len=4096"])
    with pytest.raises(fpscale.ConfigError, match=r"train.global_batch': must be micro_batch x grad_accum"):
        fpscale.load_config(None, ["train.micro_batch=3", "train.grad_accum=2", "train.global_batch=8"])
    with pytest.raises(fpscale.ConfigError, match=r"train.global_batch_tokens': must be a whole number of "
                                                  r"sequences of data.seq_len 128: 1000 / 128"):
        fpscale.load_config(None, ["data.seq_len=128", "train.global_batch_tokens=1000"])


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_batch_resolves_on_8_to_64_ranks(path):
    """Every recipe runs unchanged on 1 node or 8: its global batch (a token count for the GPU
    recipes) splits as micro-batch <= train.micro_batch x accumulation on DP 1, 8, 16, 32 and 64,
    the same number of tokens per step on each."""
    from fpscale.train.config import resolve_batch
    cfg = fpscale.load_config(path)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    if cfg.train.global_batch_tokens:
        assert tokens == cfg.train.global_batch_tokens
    for dp in (1, 8, 16, 32, 64):
        if cfg.train.global_batch < dp:       # the tiny CPU configs (16 sequences a step): an error with the fix
            with pytest.raises(ValueError, match=rf"do not split over {dp} data-parallel ranks: use a multiple "
                                                 rf"of {dp} \(e.g. {dp}\)"):
                resolve_batch(cfg.train, dp)
            continue
        plan = resolve_batch(cfg.train, dp)
        assert plan.micro_batch * plan.grad_accum * dp * cfg.data.seq_len == tokens, dp
        assert 1 <= plan.micro_batch <= cfg.train.micro_batch, dp
        if cfg.train.precision == "bf16":      # a GPU recipe: the seeds' batch size, no micro-batch of 1 or 2
            assert plan.micro_batch >= 4, dp


def test_batch_plan_derives_the_split_or_names_the_fix():
    from fpscale.train.config import resolve_batch
    t = fpscale.load_config(None, ["data.seq_len=128", "train.global_batch_tokens=32768",
                                   "train.micro_batch=8"]).train
    assert t.global_batch == 256
    assert [(p.micro_batch, p.grad_accum) for p in map(lambda dp: resolve_batch(t, dp), (1, 8, 16, 32, 64))] == \
        [(8, 32), (8, 4), (8, 2), (8, 1), (4, 1)]
    assert resolve_batch(t, 1).describe(128) == "global batch 256 x 128 tokens = micro-batch 8 x grad_accum 32 " \
                                                "x data-parallel 1"
    with pytest.raises(ValueError, match=r"train.global_batch = 256 sequences do not split over 24 data-parallel "
                                         r"ranks: use a multiple of 24 \(e.g. 240 or 264\)"):
        resolve_batch(t, 24)
    t.grad_accum = 4
    with pytest.raises(ValueError, match=r"must equal train.micro_batch \(8\) x train.grad_accum \(4\) x "
                                         r"data-parallel size \(16\) = 512; set train.grad_accum: 0 to derive it"):
        resolve_batch(t, 16)
    assert resolve_batch(t, 8).grad_accum == 4


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
        if not spec.looped:            # no solver: attn, and epsilon (learned halting)
            continue
        solver = cfg.solver.with_overrides(spec.solver, f"model.layers.{i}.solver")
        if spec.type == "attractor":   # Attractor's recipe: every sample converged (p = 0, their solvers.py:110),
            continue                   # evaluated at its training cap (depths 1/2/4 below it): their configs
        assert solver.stop_quantile == 0.25 and int(solver.stop_quantile * cfg.train.micro_batch) >= 1
        if solver.max_iter > 1:          # max_iter 1: a plain (one-pass) layer, such as 125m_mamba's
            assert solver.eval_iterations >= 2 * solver.max_iter


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_bounds_what_an_uncatchable_kill_loses(path):
    """Every recipe states its save interval in steps and in minutes (SIGKILL or a dead node saves
    nothing: a run loses at most one interval), and the step interval is a small part of the run."""
    import yaml
    train = yaml.safe_load(open(path))["train"]
    assert train.get("save_interval", 0) > 0 and train.get("save_interval_minutes", 0) > 0, path
    assert train["save_interval"] <= train["steps"] // 6


def test_the_attractor_recipes_are_their_configs():
    from fpscale.solvers.precision import residual_floor

    """configs/{140m,370m,770m}_attractor.yaml carry jacobfa/Attractor's architecture and solver settings
    (attractor/configs/attractor/*.py at fcf045f; the solve per token: causal) and its batch and token budget
    (launch_configs)."""
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    theirs = {"140m": (1024, 8, 7, 1, 0.75, 0.75, 64, 6, 3e-4, 1.0, "neumann1", 6, 11.2e9),
              "370m": (1280, 10, 15, 2, 0.75, 1.0, 64, 8, 2e-4, 1.0, "neumann1", 6, 29.6e9),
              "770m": (1280, 10, 35, 2, 0.73, 0.9, 32, 6, 1.5e-4, 0.96, "implicit", 6, 61.6e9)}
    for label, (d, heads, backbone, blocks, gate, gmax, mx, mn, tol, beta, bw, bmn, tokens) in theirs.items():
        cfg = fpscale.load_config(os.path.join(root, f"{label}_attractor.yaml"), ["train.precision=fp32"])
        attn, head = cfg.model.layers
        s = cfg.solver.with_overrides(head.solver, "solver")
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.mlp_ratio, cfg.model.rope_theta) == (d, heads, 4.0, 5e4)
        assert (attn.repeat, attn.mlp, attn.qk_norm, attn.init) == (backbone, "relu2", True, "scaled_zero_ortho")
        assert (head.type, head.head_blocks, head.gate_init, head.gamma_max) == ("attractor", blocks, gate, gmax)
        assert (s.max_iter, s.min_iter, s.damping, s.backward, s.backward_min_iter) == (mx, mn, beta, bw, bmn)
        floor = residual_floor(torch.bfloat16, norm="l2")     # their tol where bf16 resolves it, else the floor
        assert s.tol == pytest.approx(max(tol, floor), rel=0.01) and s.backward_tol == s.tol
        # their solve made causal (docs/attractor.md): per-token residual, decisions and Anderson
        assert (s.anderson, s.anderson_variant, s.norm, s.decisions, s.stop_quantile, s.patience) == (
            5, "fpscale", "l2", "token", 0.0, 0)
        assert not s.mask_unconverged and cfg.model.norm_eps == 1e-5 and cfg.model.vocab_size == 32768
        assert cfg.train.global_batch_tokens == 524288 and abs(cfg.train.steps * 524288 - tokens) < 524288
