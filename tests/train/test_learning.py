"""A tiny model of each type learns: the loss on a periodic task falls well below its start."""
import math

import pytest

import fpscale
from fpscale.models import layer_spec
from fpscale.train.trainer import Trainer

SOLVERS = {
    "attn": {},
    "fpsa": {"freeze_converged": True},
    "fpmamba": {"tol": 0.1, "backward": "jfb", "patience": 3, "decay": 0.5},
    "looped": {"backward": "phantom", "phantom_steps": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("layer_type", list(SOLVERS))
def test_tiny_model_learns(layer_type, tmp_path):
    cfg = fpscale.load_config(None, [
        "data.source=synthetic", "data.seq_len=32", "data.period=3", "model.vocab_size=16", "model.d_model=32",
        "model.max_seq_len=64", "train.steps=100", "train.micro_batch=16", "train.global_batch=16",
        "train.eval_interval=100", "train.log_interval=100", "train.warmup=10", "train.lr=1e-2",
        "train.min_lr=1e-3", "solver.forward.tol=1e-2", "solver.forward.max_iter=20", f"train.out_dir={tmp_path}"])
    cfg.model.layers = [layer_spec(layer_type, **({"solver": SOLVERS[layer_type]} if layer_type != "attn" else {}))]
    history = Trainer(cfg, log=False).train()
    start = math.log(16)                       # uniform prediction over the vocabulary
    final_val = [r for r in history if r["kind"] == "val"][-1]
    # the first `period` tokens of a sample are random: the floor is about 3/32 * log(16) = 0.26
    assert final_val["val_loss"] < 0.5 * start, final_val
    if layer_type != "attn":
        # validation solves at p = 0 under the cap of 20: more than one pass of the map, and a
        # solve that ends before the cap has every sample converged (fpsa and fpmamba still run
        # to the cap here after 100 steps, with some samples unconverged)
        (stats,) = final_val["layers"].values()
        assert 1 < stats["iters_mean"] and stats["iters_max"] <= 20, stats
        assert stats["converged_fraction"] == 1.0 or stats["iters_max"] == 20, stats


def epsilon_run(tmp_path, steps: int, **spec) -> list[dict]:
    cfg = fpscale.load_config(None, [
        "data.source=synthetic", "data.seq_len=16", "data.period=3", "model.vocab_size=16", "model.d_model=32",
        "model.max_seq_len=32", f"train.steps={steps}", "train.micro_batch=16", "train.global_batch=16",
        f"train.eval_interval={steps}", f"train.log_interval={steps}", "train.warmup=10", "train.lr=1e-2",
        "train.min_lr=1e-3", f"train.out_dir={tmp_path}", "train.export_final=false",
        f"model.embed_scale={32 ** 0.5}"])      # the authors' sqrt(d_model): CenterNorm keeps the scale
    cfg.model.layers = [layer_spec("epsilon", max_steps=6, **spec)]
    with Trainer(cfg, log=False) as trainer:
        return trainer.train()


@pytest.mark.slow
def test_epsilon_learns_and_reports_its_depth(tmp_path):
    """With ordinary causal attention in the block (HQSA's content bins blur the positions this
    copy-with-lag task needs). The bar is lower than the other types' (0.5 x uniform): on this
    task a block applied more than once learns slower in 100 steps (one step 1.40, halting at
    2-3 steps 2.2-2.3; docs/layers.md, Epsilon), a finding, not a defect found so far."""
    history = epsilon_run(tmp_path, 100, attention="causal")
    final_val = [r for r in history if r["kind"] == "val"][-1]
    assert final_val["val_loss"] < 0.9 * math.log(16), final_val
    (stats,) = final_val["layers"].values()
    assert 1.0 <= stats["depth_mean"] <= stats["iters_max"] <= 6 and stats["kl"] >= 0, stats
    assert stats["halted_by_step_6"] == 1.0
    train = [r for r in history if r["kind"] == "train"][-1]
    assert train["aux_loss"] != 0.0 and train["ppl"] == pytest.approx(math.exp(train["loss"]))


@pytest.mark.slow
def test_a_higher_halting_prior_mean_learns_a_deeper_epsilon(tmp_path):
    """The same data, model and seed, 60 steps, with target_halting_mean 1.5 and 4: the KL term
    alone must make the second deeper. kl_weight 1 (the paper's 0.015 moves the depth too
    slowly for a test of seconds); both start at the same halting heads (lambda = 0.5)."""
    depth = {}
    for mean in (1.5, 4.0):
        history = epsilon_run(tmp_path / str(mean), 60, target_halting_mean=mean, kl_weight=1.0)
        depth[mean] = [r for r in history if r["kind"] == "val"][-1]["layers"]["layers.0.epsilon"]["depth_mean"]
    assert depth[4.0] > depth[1.5] + 0.15, depth
