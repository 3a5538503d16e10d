"""lm-evaluation-harness evaluates an exported checkpoint offline, on the fpscale_cloze task built
from held-out documents, at the depth given in --model_args (the README's command)."""
import glob
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
    loglik = {}
    for depth in (1, 8):
        out = tmp_path / f"depth_{depth}"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={folder},trust_remote_code=True,eval_depth={depth}", "--include_path",
               str(tmp_path / "tasks"), "--tasks", "fpscale_cloze", "--batch_size", "4", "--device", "cpu",
               "--output_path", str(out), "--log_samples"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
        report = json.load(open(results))
        assert 0.0 <= report["results"]["fpscale_cloze"]["acc,none"] <= 1.0
        assert report["config"]["model_args"]["eval_depth"] == depth
        (samples,) = glob.glob(str(out / "**" / "samples_fpscale_cloze_*.jsonl"), recursive=True)
        rows = [json.loads(line) for line in open(samples)]
        assert len(rows) == 12
        loglik[depth] = [r["filtered_resps"] for r in rows]
    assert loglik[1] != loglik[8]          # the depth reached the looped layers
