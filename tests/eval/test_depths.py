"""Evaluation depth: a looped layer iterates more in evaluation than in training
(solver.eval_max_iter), and the depth sweep (test-time compute) of launch/evaluate.py --depths and
of train.eval_depths writes one record per depth."""
import json

import pytest
import torch

import fpscale
from fpscale.cli.evaluate import main as evaluate_main
from fpscale.config import config_from_dict

# a tiny model with two looped layers whose solves converge slowly (tol 1e-6, no damping decay)
TINY = {
    "name": "depths", "seed": 1234,
    "model": {"vocab_size": 16, "d_model": 32, "n_heads": 2, "max_seq_len": 32,
              "layers": [{"type": "attn"}, {"type": "looped", "core_blocks": 1},
                         {"type": "fpmamba", "d_state": 4, "solver": {"backward": "jfb"}}]},
    "solver": {"max_iter": 4, "eval_max_iter": 32, "tol": 1e-6, "patience": 0, "stop_quantile": 0.0,
               "backward": "phantom", "phantom_steps": 2},
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 2, "micro_batch": 4, "global_batch": 4, "warmup": 1, "log_interval": 1,
              "eval_interval": 2, "eval_batches": 2},
}


@pytest.mark.slow
def test_evaluation_iterates_past_the_training_cap():
    cfg = config_from_dict(TINY)
    torch.manual_seed(0)
    model = fpscale.build_model(cfg)
    tokens = torch.randint(0, 16, (4, 16))
    model.train()
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    train = model.solver_stats()
    assert set(train) == {"layers.1.looped", "layers.2.fpmamba"}
    assert all(s.max_iter == 4 and s.iterations <= 4 for s in train.values())
    model.eval()
    with torch.no_grad():
        model(tokens[:, :-1], targets=tokens[:, 1:])
    evaluation = model.solver_stats()
    assert all(s.max_iter == 32 and 4 < s.iterations <= 32 for s in evaluation.values()), \
        {n: (s.iterations, s.max_iter) for n, s in evaluation.items()}
    with torch.no_grad(), model.eval_depth(2):         # the depth overrides eval_max_iter, then is restored
        model(tokens[:, :-1], targets=tokens[:, 1:])
    assert all(s.max_iter == 2 and s.iterations == 2 for s in model.solver_stats().values())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step one-process run with train.eval_depths = [1, 4]: (its history, its run folder)."""
    from fpscale.train.trainer import Trainer
    out = tmp_path_factory.mktemp("runs")
    cfg = config_from_dict(TINY, [f"train.out_dir={out}", "train.eval_depths=[1,4]"])
    trainer = Trainer(cfg, log=True)
    return trainer.train(), out / "depths"


@pytest.mark.slow
def test_trainer_validates_at_each_eval_depth(trained):
    history, run = trained
    (val,) = [r for r in history if r["kind"] == "val"]
    assert [d["depth"] for d in val["depths"]] == [1, 4]
    for d in val["depths"]:
        assert d["val_loss"] > 0 and set(d["layers"]) == {"layers.1.looped", "layers.2.fpmamba"}
        assert all(st["iters_max"] <= d["depth"] for st in d["layers"].values())
        assert val[f"val_loss_depth_{d['depth']}"] == d["val_loss"]
    assert all(st["iters_mean"] == 1 for st in val["depths"][0]["layers"].values())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [d["depth"] for d in logged[-1]["depths"]] == [1, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert {"val/val_loss_depth_1", "val/val_loss_depth_4", "val/val_ppl_depth_4",
            "val/val_iters_mean_depth_4"} <= set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_evaluate_cli_sweeps_depths(trained, tmp_path, capsys):
    _, run = trained
    ckpt = run / "checkpoints" / "step_00000002"
    assert evaluate_main(["--checkpoint", str(ckpt), "--out", str(tmp_path), "--depths", "8,1,2"]) == 0
    report = json.load(open(tmp_path / "eval.json"))
    records = report["depths"]
    assert [r["depth"] for r in records] == [1, 2, 8]
    for r in records:
        assert r["val_loss"] > 0 and set(r["layers"]) == {"layers.1.looped", "layers.2.fpmamba"}
        assert {"iters_mean", "iters_max", "residual_p50"} <= set(r["layers"]["layers.1.looped"])
    assert all(st["iters_mean"] == st["iters_max"] == 1 for st in records[0]["layers"].values())
    for name in records[0]["layers"]:
        means = [r["layers"][name]["iters_mean"] for r in records]
        assert means == sorted(means), (name, means)
    # the top-level fields stay the run at the configured cap (eval_max_iter 32)
    assert max(st["iters_max"] for st in report["layers"].values()) > 8
    assert (tmp_path / "depth.png").stat().st_size > 1000 and (tmp_path / "iterations.png").exists()
    out = capsys.readouterr().out
    assert "depth sweep" in out and "layers.1.looped" in out


@pytest.mark.slow
def test_evaluate_cli_without_depths_writes_no_sweep(trained, tmp_path):
    _, run = trained
    assert evaluate_main(["--checkpoint", str(run / "checkpoints" / "step_00000002"),
                                "--out", str(tmp_path)]) == 0
    assert "depths" not in json.load(open(tmp_path / "eval.json")) and not (tmp_path / "depth.png").exists()


@pytest.mark.parametrize("depths", ["0,4", "a", "", "2,,4", "-1"])
def test_evaluate_cli_rejects_bad_depths(depths, tmp_path, capsys):
    assert evaluate_main(["--checkpoint", str(tmp_path), "--depths", depths]) == 2
    assert "--depths" in capsys.readouterr().err


@pytest.mark.parametrize("depths", ["[0, 4]", "[2, 2]"])
def test_eval_depths_config_names_the_key(depths):
    with pytest.raises(fpscale.ConfigError, match="train.eval_depths"):
        config_from_dict(TINY, [f"train.eval_depths={depths}"])
