"""experiments/gpu_tables.py (issue 50): the device-drawn tasks follow SyntheticTask's rules, a table cut at its cap
keeps the rows that finished, and the script itself runs at CPU sizes with the arguments the GPU call gives it,
in an interpreter where deepspeed, pydantic and hjson cannot be imported (the lent GPU's image has none of them)."""
import json
import sys
import time

import numpy as np
import pytest
import torch

from experiments.device_tasks import GroupWords, InductionBatches, prefix_products
from experiments.gpu_tables import TableTimeout, rows_of, run_table, sizes
from fpscale.data.synthetic import IGNORE, SyntheticTask, cayley_table, group_elements, group_products
from tests.parallel.launch import run


@pytest.mark.parametrize("group", ["s3", "a5"])
def test_group_words_are_their_prefix_products(group):
    task = GroupWords(group, 256, "cpu", seed=3)
    inputs, targets = task.examples(range(6))
    assert inputs.shape == targets.shape == (6, 256)
    for word, target in zip(inputs.numpy(), targets.numpy()):
        assert (target == group_products(group, word)).all()
    # the scan itself against the left-to-right product, at a length that is not a power of 2
    word = torch.randint(0, len(group_elements(group)), (3, 37))
    got = prefix_products(torch.as_tensor(cayley_table(group)), word)
    assert all((g.numpy() == group_products(group, w.numpy())).all() for g, w in zip(got, word))


def test_group_words_follow_the_authors_conventions():
    """BOS in front (its target scored with score_specials, else ignored); a short word padded with PAD."""
    n = len(group_elements("s3"))
    inputs, targets = GroupWords("s3", 16, "cpu", 0, start_token=True, short_fraction=1.0,
                                 score_specials=True).examples(range(4))
    assert inputs.shape == (4, 17) and (inputs[:, 0] == n).all() and (targets[:, 0] == n).all()
    assert (inputs[:, 3:] == n + 1).all() and (targets[:, 3:] == n + 1).all()
    ref = SyntheticTask("s3", n + 2, 16, 0, start_token=True, short_fraction=1.0, score_specials=True).example(0)
    assert (ref[0][3:] == n + 1).all() and ref[0][0] == n            # SyntheticTask's own layout
    inputs, targets = GroupWords("s3", 8, "cpu", 0, start_token=True).examples(range(4))
    assert (targets[:, 0] == IGNORE).all() and (inputs[:, 1:] < n).all()


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_induction_batches_hold_the_task(k):
    """One true pair (A, B) in the first half, K pairs (A, D != B) after it, no other A before the query,
    the only target B at MASK: SyntheticTask's induction rule (and its slot range for the true pair)."""
    vocab, T = 12, 24
    inputs, targets = InductionBatches(vocab, T, "cpu", seed=1, distractors=k).examples(range(200))
    slots = (T - 2) // 2
    firsts = []
    for seq, tgt in zip(inputs.numpy(), targets.numpy()):
        a, b = seq[T - 2], tgt[T - 1]
        assert seq[T - 1] == vocab - 1 and (tgt[:T - 1] == IGNORE).all() and b != a
        at = np.flatnonzero(seq[:T - 2] == a)
        assert (at % 2 == 0).all() and len(at) == k + 1, (seq, k)
        assert seq[at[0] + 1] == b and all(seq[p + 1] != b for p in at[1:])
        firsts.append(at[0] // 2)
    assert max(firsts) < max(1, min(slots // 2, slots - k))
    mixed = InductionBatches(vocab, T, "cpu", seed=1, mixed=(0, 4)).examples(range(10))[0]
    assert [int((s[:T - 2] == s[T - 2]).sum()) for s in mixed] == [1] * 5 + [5] * 5
    with pytest.raises(ValueError, match="distractor pairs need"):
        InductionBatches(vocab, T, "cpu", seed=1, distractors=slots - 1)


def test_a_table_cut_at_its_cap_keeps_the_rows_that_finished():
    """Two rows finish, the third outlives cap + grace (SIGALRM): a timeout, the fourth skipped; every row
    recorded in order, and the alarm is off afterwards."""
    got = []

    def fake(row, seconds, deadline):
        if row["model"] == "slow":
            time.sleep(5)
        return {"acc": {"16": 1.0}}

    rows = [{"model": m} for m in ("a", "b", "slow", "d")]
    t0 = time.monotonic()
    run_table("t", rows, 0.3, 0.0, fake, lambda row, status, rec: got.append((row["model"], status, rec)),
              grace=0.2)
    assert time.monotonic() - t0 < 2
    assert [(m, s) for m, s, _ in got] == [("a", "ok"), ("b", "ok"), ("slow", "timeout"), ("d", "skipped")]
    assert got[0][2]["acc"] == {"16": 1.0} and "cap" in got[2][2]["why"]
    time.sleep(0.6)                       # a stray alarm would raise here
    assert issubclass(TableTimeout, Exception)


def test_rows_in_the_order_of_the_issue():
    s = sizes(full=True)
    st = rows_of("state_tracking", s["state_tracking"], [0, 1])
    assert len(st) == 16 and [r["seed"] for r in st[:8]] == [0] * 8
    assert [r["task"] for r in st[:8]] == ["s3"] * 4 + ["a5"] * 4
    assert st[0]["layers"][0]["preset"] == "authors_state_tracking" and st[0]["layers"][0]["init"] == "authors"
    assert [r["model"] for r in rows_of("induction", s["induction"], [0])][0] == "attention 2L"
    assert len(rows_of("a5", s["a5"], [0, 1])) == 4


BLOCKED = ("import sys, importlib.abc, runpy\n"
           "class B(importlib.abc.MetaPathFinder):\n"
           "    def find_spec(self, name, path, target=None):\n"
           "        if name.split('.')[0] in ('deepspeed', 'pydantic', 'hjson'):\n"
           "            raise ImportError('not on the GPU image: ' + name)\n"
           "sys.meta_path.insert(0, B())\n"
           "sys.argv = ['experiments/gpu_tables.py'] + sys.argv[1:]\n"
           "runpy.run_path('experiments/gpu_tables.py', run_name='__main__')\n")


@pytest.mark.slow        # a child process training 25 small models for a few seconds each
def test_the_script_at_cpu_sizes_with_its_real_arguments(tmp_path):
    out = tmp_path / "tables"
    proc = run([sys.executable, "-c", BLOCKED, "--tables", "state_tracking,a5,induction", "--budget-s", "30",
                "--out", str(out), "--device", "cpu", "--threads", "1"], timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    recs = [json.loads(line) for line in open(out / "results.jsonl")]
    assert [sum(r["table"] == t for r in recs) for t in ("state_tracking", "a5", "induction")] == [16, 4, 5]
    assert {r["status"] for r in recs} <= {"ok", "skipped", "timeout"}
    first = recs[0]
    assert first["status"] == "ok" and first["device"] == "cpu" and first["precision"] == "fp32"
    assert set(first["acc"]) == {"16", "32"} and first["steps"] >= 1 and first["tokens"] == first["words"] * 17
    assert first["authors_budget"]["steps"] == 127_140 and 0 < first["authors_budget"]["fraction"] < 1e-3
    assert first["config"]["layers"][0]["preset"] == "authors_state_tracking" and first["commit"]
    md = (out / "tables.md").read_text()
    assert all(f"## {t}:" in md for t in ("state_tracking", "a5", "induction")) and "CPU (smoke)" in md


@pytest.mark.slow        # the checklist and the script in child processes
def test_the_checklist_runs_the_tables_only_when_named(tmp_path):
    """``--only tables``: the step runs the script at CPU sizes within the checklist's budget (rows in
    <out>/tables/); the other steps are recorded as not asked for. The default run has no tables step
    (tests/test_gpu_scripts.py's STEPS_CPU)."""
    proc = run(["bash", "scripts/gpu_checklist.sh", "--only", "tables", "--budget-s", "45", "--out", str(tmp_path)],
               timeout=240, check=False, env={"PYTHON": sys.executable})
    recs = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    tables = [r for r in recs if r["step"] == "tables"]
    assert len(tables) == 1 and tables[0]["status"] == "ok", proc.stdout[-3000:]
    assert all(r["status"] == "skipped" and r["why"] == "not in --only" for r in recs if r["step"] != "tables")
    counts = tables[0]["result"]["table_rows"]
    assert sum(counts.values()) == 25 and counts["ok"] >= 1, counts
    assert (tmp_path / "tables" / "tables.md").exists() and proc.returncode == 0
