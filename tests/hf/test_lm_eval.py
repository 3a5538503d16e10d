"""lm-evaluation-harness evaluates an exported checkpoint offline, on the fpscale_cloze task built
from held-out documents, at the depth given in --model_args (the README's command's model_args and
evaluation, tests/hf/run_lm_eval.py)."""
import json
import os
import subprocess
import sys

import pytest

from fpscale.cli.lm_eval_task import main as task_main
from fpscale.hf.export import export_hf
from tests.hf.test_export import TEXTS, weights_folder

pytest.importorskip("lm_eval")


def documents(path) -> str:
    """A jsonl of FineWeb-schema documents of several sentences each."""
    with open(path, "w") as fh:
        for i in range(30):
            text = " ".join(f"Sentence {j} of document {i} says that {TEXTS[(i + j) % len(TEXTS)].strip()}"
                            for j in range(6))
            fh.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    return str(path)


def test_task_needs_validation_documents(tmp_path, capsys):
    assert task_main(["--files", documents(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "t"),
                      "--val-fraction", "0"]) == 2
    assert "no validation document" in capsys.readouterr().err


@pytest.mark.slow
def test_lm_eval_runs_the_offline_task_at_depths_1_and_8(tmp_path):
    from tests.hf.test_export import train_tokenizer
    tok = train_tokenizer(TEXTS * 50, str(tmp_path / "tokenizer"), vocab_size=320, threads=1)
    folder = export_hf(weights_folder("tiny_mixed", tmp_path / "weights"), str(tmp_path / "hf"), tokenizer=tok)
    assert task_main(["--files", documents(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "tasks"),
                      "--val-fraction", "1", "--items", "12"]) == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # both depths in one process (tests/hf/run_lm_eval.py: the CLI's model_args and simple_evaluate,
    # without its index of lm_eval's bundled tasks, 30+ s per CLI run here)
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_lm_eval.py")
    cmd = [sys.executable, driver, folder, str(tmp_path / "tasks"), str(tmp_path / "report.json"), "1", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "report.json"))
    for depth in (1, 8):
        assert 0.0 <= report[str(depth)]["acc"] <= 1.0
        assert report[str(depth)]["eval_depth"] == depth          # the model_args string reached the model
        assert len(report[str(depth)]["rows"]) == 12
    assert report["1"]["rows"] != report["8"]["rows"]         # the depth reached the looped layers
