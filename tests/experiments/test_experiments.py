"""Each experiment's --quick run, in process: it checks the pipeline (training, evaluation, the table,
the JSON and PNG), not the result. Each trains every model of its experiment for a few steps and
evaluates it (10-60 s on the 2-core machine), so they are in the full suite, not the quick loop."""
import importlib
import json
import sys

import pytest
import torch

EXPERIMENTS = ["language", "looped_recipe", "state_tracking", "state_tracking_authors", "state_tracking_rerun",
               "stability", "induction", "copy_task", "length_generalisation", "trainability", "sudoku", "classify",
               "optimizers", "attractor"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_quick_run(name, tmp_path, monkeypatch, capsys, prepared):
    module = importlib.import_module(f"experiments.{name}")
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", [name, "--quick", "--threads", str(threads), "--out", str(tmp_path),
                                      "--data", prepared + "/tokens"])
    try:
        module.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| " in out                                      # a table on stdout
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["experiment"] == name and data["quick"] is True
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
