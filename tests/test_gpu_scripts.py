"""The GPU scripts' pipelines on CPU (their figures need a GPU): scripts/gpu_smoke.sh runs its whole
matrix, two CPU processes standing in for two GPUs, one line per run; scripts/gpu_checklist.sh runs its
steps at CPU sizes within its budget, recording each. Its recipes step is bench/gpu.py over every 125m
recipe (tables and JSON as it goes; synthetic tokens without FineWeb, said so): it stands in for a
separate bench/gpu.py run of 125m_fpsa at sequence 2048 (3 CPU minutes for one bf16 step), whose
checks it now holds. The smoke matrix keeps what can fail on CPU (the head size, the sequence, bf16,
every layout) and cuts what only costs CPU time (the copies of each block, ``repeat``, most of the
vocabulary and two thirds of the width: ONE_EACH); the recipes at their full width and vocabulary
trained on a GPU (docs/gpu.md, "The first GPU run": bench/gpu.py, every 125m recipe).
Every command runs in its own process group, killed whole with its test (tests/parallel/launch.run)."""
import json
import os
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run

# the 125m_fpsa recipe with one copy of each of its three blocks (attn x6, fpsa x2, attn x6), and a
# vocabulary of 1152 = 128 x 9 for its 50304 = 128 x 393: the same divisibility (by tp, by 64), 2% of
# the embedding and output layer, which held 77M of its 98M parameters with one block each and made
# a CPU step minutes long (bf16 autocast, AdamW over all of them); and a width of 256 over 4 heads for
# its 768 over 12: the same head size (64, what SDPA's and flash-attn's kernels see), a ninth of the
# matmul work (the matrix took 330 s of the suite's CPU time at 768)
ONE_EACH = ["model.layers.0.repeat=1", "model.layers.1.repeat=1", "model.layers.2.repeat=1", "model.vocab_size=1152",
            "model.d_model=256", "model.n_heads=4"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpu_smoke_matrix_runs_on_cpu(tmp_path):
    """The whole matrix with the GPU runs' own arguments (configs, sequence, batch, bf16, layouts): only the
    device differs, and on CPU the flash=0 twin of each auto run (SDPA either way) is not run twice."""
    env = {"FPSCALE_SMOKE_CPU": "1", "FPSCALE_SMOKE_OUT": str(tmp_path),
           "FPSCALE_SMOKE_CONFIG_OVERRIDES": " ".join(ONE_EACH)}
    proc = run(["bash", "scripts/gpu_smoke.sh"], timeout=1200, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    lines = proc.stdout.splitlines()
    runs = [line.split()[1] for line in lines if line.startswith(("ok ", "FAIL", "same "))]
    assert runs == ["tiny_mixed-1proc-auto", "tiny_mixed-1proc-sdpa", "125m_fpsa-1proc-auto", "125m_fpsa-1proc-sdpa",
                    "tiny_mixed-dp2-zero1", "tiny_mixed-dp2-zero3", "125m_fpsa-dp2-zero1", "125m_fpsa-dp2-zero3",
                    "125m_fpsa-tp2xdp1-zero1"], proc.stdout
    ran = [line for line in lines if line.strip().startswith("ran:")]
    assert len(ran) == 7, proc.stdout
    # bf16 autocast: q, k and v reach attention in bf16 (SDPA's flash backend would take them on a GPU)
    assert all("attention: sdpa bf16" in line for line in ran), proc.stdout
    assert "scan:" in ran[0], proc.stdout                    # tiny_mixed's fpmamba layer: the scan that ran
    config = (tmp_path / "125m_fpsa-dp2-zero1" / "config.yaml").read_text()
    assert "seq_len: 128" in config and "precision: bf16" in config and "d_model: 256" in config
    assert "vocab_size: 1152" in config and "n_heads: 4" in config


@pytest.mark.slow     # a child process (imports torch: seconds): the full suite, not the quick loop
def test_gpu_bench_out_of_budget_writes_what_it_skipped(tmp_path):
    """A budget already spent: nothing is started, and the JSON names every run it skipped. On CPU the
    largest-micro-batch search of each looped config is reported as needing a GPU (no budget needed)."""
    out = tmp_path / "gpu.json"
    run([sys.executable, "bench/gpu.py", "--quick", "--budget-s", "1e-9", "--out", str(out)], timeout=300)
    result = json.loads(out.read_text())
    assert result["complete"] and result["rows"] == []
    assert result["skipped"] == ["tiny_attn flash=auto micro=2 compile=auto",
                                 "tiny_fpsa flash=auto micro=2 compile=auto"]      # (the fit needs a GPU)
    assert result["fit_rows"] == [{"config": "tiny_fpsa", "iterations": 16, "max_micro_implicit": "needs a GPU",
                                   "max_micro_unroll": "needs a GPU"}]


STEPS_CPU = ["env", "kernels", "ds_zero1", "ds_zero3", "ds_compare", "recipes", "scan", "solver", "chunks", "speed"]


def gpu_plan(tmp_path) -> list[dict]:
    """scripts/gpu_checklist.py's steps on a GPU (its plan, built here without one)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_checklist
    finally:
        sys.path.pop(0)
    return gpu_checklist.plan_steps(sys.executable, True, tmp_path)


def records(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]


@pytest.mark.slow
def test_gpu_checklist_on_cpu_finishes_under_its_budget(tmp_path):
    """Every step at CPU sizes, one record each, all ok, inside the default budget (420 s); the summary
    names the device and holds the recipes' table."""
    t0 = time.monotonic()
    proc = run(["bash", "scripts/gpu_checklist.sh", "--out", str(tmp_path)], timeout=600, check=False,
               env={"PYTHON": sys.executable})
    elapsed = time.monotonic() - t0
    got = records(tmp_path)
    assert [r["step"] for r in got] == STEPS_CPU, proc.stdout[-3000:]
    assert all(r["status"] == "ok" for r in got), [(r["step"], r["status"], r.get("tail")) for r in got]
    assert proc.returncode == 0 and elapsed < 420, (elapsed, proc.stdout[-2000:])
    assert {r["result"]["engine"] for r in got if r["step"].startswith("ds_zero")} == {"deepspeed"}
    recipes = next(r for r in got if r["step"] == "recipes")["result"]
    assert recipes["complete"] and recipes["skipped"] == []
    rows = {row["config"]: row for row in recipes["rows"]}
    assert sorted(rows) == sorted(p[:-5] for p in os.listdir(os.path.join(ROOT, "configs")) if p.startswith("125m_"))
    # bench/gpu.py as a GPU machine without FineWeb runs it: synthetic tokens, said so; one step, micro-batch 1
    log = (tmp_path / "logs" / "recipes.log").read_text()
    assert "125m_fpsa: synthetic tokens (no prepared token shards in cache/fineweb/tokens" in log, log[-2000:]
    assert all(row["data"] == "synthetic" and row["micro"] == 1 and row["plan_gib"] is not None
               for row in rows.values()), rows
    row = rows["125m_fpsa"]
    assert row["tokens_per_s"] > 0 and row["tflops_executed"] > 0 and row["peak_gib"] > 0 and row["plan_gib"] > 0
    # bf16 autocast: q, k, v reach SDPA in bf16; the fpsa layers' iterations are counted (6 attn, 2 fpsa, 6 attn)
    assert row["attention"] == "sdpa bf16" and [i.split(":")[0] for i in row["iters"].split()] == ["6", "7"], row
    summary = (tmp_path / "summary.md").read_text()
    assert "device: none (CPU)" in summary and "| recipes | ok |" in summary and "| 125m_fpsa |" in summary
    chunks = next(r for r in got if r["step"] == "chunks")["result"]     # issue 39: graphed needs CUDA, said
    assert [row["mode"] for row in chunks["rows"]] == ["eager", "compiled"], chunks
    assert any("graphed" in s and "CUDA" in s for s in chunks["skipped"]), chunks
    speed = next(r for r in got if r["step"] == "speed")["result"]    # issue 46: the profile and eager vs compiled
    assert speed["complete"] and [r["name"] for r in speed["runs"]] == [
        "profile_125m_attn_none", "profile_125m_attn_auto", "gpu_125m_attn"], speed
    assert all(r["status"] == "ok" for r in speed["runs"]) and speed["runs"][0]["graph_breaks"] == 0
    assert [row["compile"] for row in speed["runs"][2]["rows"]] == ["none", "auto"]
    assert "| profile_125m_attn_none | ok | none |" in summary


@pytest.mark.slow
def test_gpu_checklist_ends_on_time_and_names_what_it_skipped(tmp_path):
    """--budget-s 30: it returns within the budget (+ the kill's grace), every step is recorded, the
    finished ones ok, the one cut short as a timeout, the rest named as skipped; summary.md is there."""
    t0 = time.monotonic()
    proc = run(["bash", "scripts/gpu_checklist.sh", "--budget-s", "30", "--out", str(tmp_path)], timeout=120,
               check=False, env={"PYTHON": sys.executable})
    elapsed = time.monotonic() - t0
    assert elapsed < 30 + 10, elapsed
    assert proc.returncode == 1
    got = records(tmp_path)
    assert [r["step"] for r in got] == STEPS_CPU, proc.stdout
    status = [r["status"] for r in got]
    assert status[0] == "ok" and status[-1] == "skipped", status
    assert set(status) <= {"ok", "timeout", "skipped"} and status.count("timeout") <= 1, status
    first_skip = status.index("skipped")
    assert all(s == "skipped" for s in status[first_skip:]), status
    assert (tmp_path / "summary.md").exists() and "skipped" in (tmp_path / "summary.md").read_text()


def test_gpu_checklist_gpu_plan_passes_config_validation(tmp_path):
    """The GPU branch's training runs (never run in CI, which has no GPU) are valid configs: the first
    GPU run failed all four on data.seq_len 256 > tiny_mixed's max_seq_len 128."""
    import fpscale
    trains = [s for s in gpu_plan(tmp_path) if "launch/pretrain.py" in s["cmd"]]
    assert [s["name"] for s in trains] == ["ds_zero1", "ds_zero1_torch", "ds_zero3", "ds_zero3_torch"]
    for step in trains:
        cmd = [str(c) for c in step["cmd"]]
        args = cmd[cmd.index("--config") + 1:]
        cfg = fpscale.load_config(os.path.join(ROOT, args[0]), args[1:])
        assert cfg.train.precision == "bf16" and cfg.data.seq_len <= cfg.model.max_seq_len


@pytest.mark.slow        # the checklist and the bench in child processes
def test_the_checklist_decodes_the_recipes_only_when_named(tmp_path):
    """``--only decode`` (issue 51): bench/decode.py on the 125m recipes and 140m_attractor, both cache modes, at
    CPU sizes here (the GPU plan: fp32 on cuda, T 512 and 2048); the default run has no decode step."""
    proc = run(["bash", "scripts/gpu_checklist.sh", "--only", "decode", "--budget-s", "120", "--out", str(tmp_path)],
               timeout=240, check=False, env={"PYTHON": sys.executable})
    got = records(tmp_path)
    decode = [r for r in got if r["step"] == "decode"]
    assert len(decode) == 1 and decode[0]["status"] == "ok", proc.stdout[-3000:]
    result = decode[0]["result"]
    assert result["complete"] and proc.returncode == 0
    rows = {(row["config"], row["mode"]): row for row in result["rows"]}
    configs = ["125m_attn", "125m_fpsa", "125m_looped", "125m_fpmamba", "140m_attractor"]
    assert sorted(rows) == sorted((c, m) for c in configs for m in ("exact", "fixed_point"))
    assert all(row["device"] == "cpu" and row["ms_per_token"] > 0 and row["cache_bytes"] > 0 for row in rows.values())
    # the looped recipes keep a plain model's K/V per block in fixed_point, more in exact
    for c in ("125m_looped", "140m_attractor"):
        assert rows[(c, "fixed_point")]["cache_bytes"] < rows[(c, "exact")]["cache_bytes"], c
    (gpu,) = [s for s in gpu_plan(tmp_path) if s["name"] == "decode"]
    assert gpu["cmd"][gpu["cmd"].index("--device") + 1] == "cuda" and gpu.get("opt_in")


@pytest.mark.slow        # the checklist and the bench in child processes, dynamo tracing the models
def test_the_checklist_decodes_compiled_steps_only_when_named(tmp_path):
    """``--only decode_compiled`` (issue 51): the decoding step eager, compiled and compiled over static caches for
    125m_attn, 125m_looped and 140m_attractor (CPU sizes and dynamo's eager backend here; the GPU plan:
    reduce-overhead, T 2048): the same solves whatever the step."""
    proc = run(["bash", "scripts/gpu_checklist.sh", "--only", "decode_compiled", "--budget-s", "200", "--out",
                str(tmp_path)], timeout=300, check=False, env={"PYTHON": sys.executable})
    (step,) = [r for r in records(tmp_path) if r["step"] == "decode_compiled"]
    assert step["status"] == "ok" and step["result"]["complete"] and proc.returncode == 0, proc.stdout[-3000:]
    rows = {(row["config"], row["step"]): row for row in step["result"]["rows"]}
    configs = ["125m_attn", "125m_looped", "140m_attractor"]
    assert sorted(rows) == sorted((c, s) for c in configs for s in ("eager", "compiled", "compiled_static"))
    for c in configs:
        assert len({rows[c, s]["iters_per_token"] for s in ("eager", "compiled", "compiled_static")}) == 1, c
    (gpu,) = [s for s in gpu_plan(tmp_path) if s["name"] == "decode_compiled"]
    assert gpu["cmd"][gpu["cmd"].index("--compile-mode") + 1] == "reduce-overhead" and gpu.get("opt_in")
