"""The GPU checklist: one command, no network, a global deadline; each step's result is appended to
``<out>/results.jsonl`` as soon as it exists and ``<out>/summary.md`` is rewritten after every step,
so a timeout (of a step, of the budget, of the whole command) still leaves every finished step.

    bash scripts/gpu_checklist.sh                     # --budget-s 420, into gpu_report/
    bash scripts/gpu_checklist.sh --budget-s 30 --out /tmp/report
    bash scripts/gpu_checklist.sh --only env,chunks       # some steps (the rest recorded as skipped)

Steps, in order (on a CPU the same steps at CPU sizes, which is what CI runs):
  env         GPU, driver, torch, Triton, DeepSpeed, and the kernels each layer type will use
  kernels     tests/ops/test_kernels_on_device.py (the Triton scan, mamba-ssm and flash-attn against
              the PyTorch paths on the device) and tests/solvers/test_fused.py's quick tests (its kernel
              tests run under Triton's interpreter, a CPU check: the fused bookkeeping meets the GPU in
              the ds_* steps below, against the torch loop)
  ds_zero1 / ds_zero1_torch / ds_zero3 / ds_zero3_torch
              tiny_mixed in bf16 through ``deepspeed --num_gpus 1`` (20 steps on a GPU, 3 on CPU) with
              ZeRO-1 and ZeRO-3, the solver's bookkeeping auto (fused on a GPU) and torch (the _torch
              twins: on a GPU only; on CPU auto is the torch loop)
  ds_compare  those runs' losses and iterations: fused vs torch bookkeeping the same
  recipes     bench/gpu.py: a short bf16 run of each configs/125m_*.yaml at its recipe's micro-batch
              (tokens/s, MFU nominal and executed, peak memory vs fpscale-plan for the same set-up); on
              CPU at CPU sizes; without FineWeb's token shards (CI), on synthetic tokens, said so, as on a
              GPU machine without them
  scan        bench/scan.py
  solver      bench/solver_overhead.py (host reads, ops and wall time per iteration)
  speed       bench/speed.py (issue 46): bench/profile_step.py (where a step's time goes, kernels and host syncs
              per step, graph breaks) for 125m_attn, 125m_fpsa and 125m_fpmamba eager and compiled, and
              bench/gpu.py eager vs compiled (train.compile none / auto) for every 125m recipe and
              140m_attractor at micro-batch 8, each run under its own deadline, written to <out>/speed/ as they
              finish (on CPU: 125m_attn at small width, where auto compiles nothing: the pipeline only).
              The first call of a GPU session: bash scripts/gpu_checklist.sh --only speed --budget-s 480
  chunks      bench/chunk_timing.py: the solver loop eager vs chunk-compiled vs chunk-graphed
              (solver.chunk, solver.cuda_graph), per iteration and per training step, for the 125m
              configs with a chunked solve (on CPU: 125m_fpsa at the recipes step's CPU sizes, the
              chunk traced with aot_eager, no Inductor build; the graphed column skipped, said why)
  tables      opt-in, run only when named (--only tables): experiments/gpu_tables.py, the seeds' tables
              (rows in <out>/tables/results.jsonl and tables.md as they finish; on CPU at CPU sizes)
  decode      opt-in (--only decode): bench/decode.py, cached decoding of 125m_attn, 125m_fpsa, 125m_looped,
              125m_fpmamba and 140m_attractor in both cache modes, T 512 and 2048, fp32 on the GPU (issue 51;
              on CPU at CPU sizes, --quick); <out>/decode.json rewritten as each config finishes
  decode_compiled  opt-in (--only decode_compiled): bench/decode.py's decoding step eager, compiled over dynamic
              caches and compiled over static ones (mode reduce-overhead: CUDA graphs) for 125m_attn, 125m_looped
              and 140m_attractor in fixed_point mode, T 2048 (on CPU at CPU sizes, dynamo's eager backend);
              <out>/decode_compiled.json
Each step runs in its own process group, killed whole at its bound: the smaller of its own cap and
what is left of the budget. A step that cannot start in time is recorded as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESERVE_S = 2.0          # kept back for the summary
MIN_STEP_S = 5.0         # a step is not started with less than this left


def environment_code() -> str:
    return r"""
import json, os, subprocess, torch
import fpscale
from fpscale.ops.kernel_plan import describe
try:
    import triton; tv = triton.__version__
except Exception as exc: tv = f"absent ({type(exc).__name__})"
try:
    import deepspeed; dv = deepspeed.__version__
except Exception as exc: dv = f"absent ({type(exc).__name__})"
drv = "-"
try:
    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip() or "-"
except Exception: pass
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
print(json.dumps({"gpu": gpu, "driver": drv, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv,
                  "deepspeed": dv, "fpscale": fpscale.__version__, "kernels": describe()}))
"""


def plan_steps(py: str, gpu: bool, out: Path) -> list[dict]:
    """The steps: name, command, own cap (s), and how to read its result."""
    launcher = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "0"]
    tiny = ["--config", "configs/tiny_mixed.yaml", "data.source=synthetic", "train.warmup=1", "train.log_interval=1",
            "train.eval_interval=1000000", "train.global_batch_tokens=0", "train.resume=none",
            "train.export_final=false", "train.save_interval=0", f"train.out_dir={out / 'runs'}"]
    tiny += (["train.steps=20", "data.seq_len=128", "train.global_batch=16", "train.micro_batch=16",
              "train.precision=bf16"] if gpu else
             ["train.steps=3", "data.seq_len=32", "train.global_batch=2", "train.micro_batch=2",
              "train.precision=bf16"])
    steps = [{"name": "env", "cmd": [py, "-c", environment_code()], "cap": 120, "read": "json"},
             {"name": "kernels", "cap": 240, "read": "pytest",
              "cmd": [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                      "tests/ops/test_kernels_on_device.py", "tests/solvers/test_fused.py", "-m", "not slow"]}]
    for zero in (1, 3):
        for book in ("auto", "torch") if gpu else ("auto",):       # on CPU auto is the torch loop already
            name = f"ds_zero{zero}" + ("_torch" if book == "torch" else "")
            steps.append({"name": name, "cap": 240, "read": "run", "run": out / "runs" / name,
                          "cmd": [*launcher, "launch/pretrain.py", *tiny, f"name={name}",
                                  f"parallel.zero_stage={zero}", f"solver.execution.bookkeeping={book}"]})
    steps.append({"name": "ds_compare", "cap": 30, "read": "json",
                  "cmd": [py, str(ROOT / "scripts" / "gpu_checklist.py"), "--compare", str(out / "runs")]})
    recipes = [py, "bench/gpu.py", "--micro", "0", "--no-fit", "--plan", "--no-sdpa-twin",
               "--out", str(out / "recipes.json")]
    recipes += (["--warmup", "1", "--steps", "4"] if gpu else
                ["--warmup", "0", "--steps", "1", "--micro", "1", "--override", "model.d_model=64", "model.n_heads=2",
                 "data.seq_len=64", "model.vocab_size=512", "solver.max_iter=8", "solver.eval_max_iter=8"])
    steps.append({"name": "recipes", "cmd": recipes, "cap": 300, "read": "bench", "json": out / "recipes.json",
                  "budget_flag": True})
    scan = [py, "bench/scan.py", "--out", str(out / "scan.json")]
    scan += ([] if gpu else ["--device", "cpu", "--repeats", "1", "--B", "1", "--T", "64", "--d-inner", "64"])
    steps.append({"name": "scan", "cmd": scan, "cap": 120, "read": "bench", "json": out / "scan.json"})
    solver = [py, "bench/solver_overhead.py", "--out", str(out / "solver.json")]
    solver += ([] if gpu else ["--d", "32", "--T", "16", "--B", "2", "--max-iter", "8", "--kinds", "fpsa",
                               "--modes", "implicit", "--threads", "1"])
    steps.append({"name": "solver", "cmd": solver, "cap": 180, "read": "bench", "json": out / "solver.json"})
    chunks = [py, "bench/chunk_timing.py", "--out", str(out / "chunks.json")]
    chunks += (["--warmup", "2", "--steps", "5", "--repeats", "5"] if gpu else
               ["--configs", "configs/125m_fpsa.yaml", "--backend", "aot_eager", "--micro", "1", "--repeats", "1",
                "--warmup", "1", "--steps", "1", "--threads", "1", "--override", "model.d_model=64", "model.n_heads=2",
                "data.seq_len=64", "model.vocab_size=512", "solver.max_iter=8", "solver.eval_max_iter=8",
                "model.layers.0.repeat=1", "model.layers.2.repeat=1"])
    steps.append({"name": "chunks", "cmd": chunks, "cap": 240, "read": "bench", "json": out / "chunks.json",
                  "budget_flag": True})
    speed = [py, "bench/speed.py", "--out", str(out / "speed")]
    speed += (["--traces"] if gpu else ["--cpu-sizes", "--configs", "125m_attn", "--profiles"])
    steps.append({"name": "speed", "cmd": speed, "cap": 480 if gpu else 120, "read": "speed",
                  "json": out / "speed" / "speed.json", "budget_flag": True})
    # opt-in (--only tables): the seeds' tables, experiments/gpu_tables.py, rows in tables/ as they finish
    tables = [py, "experiments/gpu_tables.py", "--out", str(out / "tables")]
    tables += [] if gpu else ["--device", "cpu", "--threads", "1"]
    steps.append({"name": "tables", "cmd": tables, "cap": 480, "read": "tables", "json": out / "tables" /
                  "results.jsonl", "budget_flag": True, "opt_in": True})
    # opt-in (--only decode): cached decoding of the recipes, both cache modes (issue 51), rows as configs finish
    recipes_decoded = ("125m_attn", "125m_fpsa", "125m_looped", "125m_fpmamba", "140m_attractor")
    decode = [py, "bench/decode.py", "--out", str(out / "decode.json"), "--configs",
              *(f"configs/{c}.yaml" for c in recipes_decoded)]
    decode += (["--device", "cuda", "--T", "512", "2048", "--new", "32", "--repeats", "3"] if gpu else
               ["--quick", "--override", "model.d_model=64", "model.n_heads=2", "model.vocab_size=512"])
    steps.append({"name": "decode", "cmd": decode, "cap": 420, "read": "bench", "json": out / "decode.json",
                  "opt_in": True})
    # opt-in (--only decode_compiled): the decoding step compiled, over dynamic and static caches (issue 51)
    compiled = [py, "bench/decode.py", "--out", str(out / "decode_compiled.json"), "--modes", "fixed_point",
                "--steps", "eager", "compiled", "compiled_static", "--configs",
                *(f"configs/{c}.yaml" for c in ("125m_attn", "125m_looped", "140m_attractor"))]
    compiled += (["--device", "cuda", "--T", "2048", "--new", "32", "--repeats", "2", "--compile-mode",
                  "reduce-overhead"] if gpu else
                 ["--quick", "--backend", "eager", "--override", "model.d_model=64", "model.n_heads=2",
                  "model.vocab_size=512"])
    steps.append({"name": "decode_compiled", "cmd": compiled, "cap": 420, "read": "bench",
                  "json": out / "decode_compiled.json", "opt_in": True})
    return steps


def run_bounded(cmd: list[str], seconds: float, log: Path, env: dict) -> tuple[int | None, float]:
    """(exit status, or None if killed at ``seconds``; wall seconds). The command runs in its own
    process group (session), killed whole at the bound: nothing it started outlives it."""
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=seconds), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return None, time.monotonic() - t0
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)       # stragglers of a finished step
            except ProcessLookupError:
                pass


def tail(path: Path, n: int = 6) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_result(step: dict, log: Path) -> dict:
    """What the record says of a finished step beyond its status."""
    try:
        if step["read"] == "json":
            return json.loads(log.read_text().strip().splitlines()[-1])
        if step["read"] == "pytest":
            return {"pytest": tail(log, 1)}
        if step["read"] == "run":
            rows = [json.loads(line) for line in open(step["run"] / "metrics.jsonl")]
            train = [r for r in rows if r["kind"] == "train"]
            return {"losses": [r["loss"] for r in train], "memory_gib": train[-1]["memory_gib"],
                    "tokens_per_s": train[-1]["tokens_per_s"],
                    "iters": {n: s["iters_mean"] for n, s in train[-1]["layers"].items()},
                    "engine": "deepspeed" if "engine deepspeed" in log.read_text() else "?"}
        if step["read"] == "speed":
            data = json.loads(Path(step["json"]).read_text())
            return {"complete": data["complete"], "skipped": data["skipped"],
                    "runs": [{"name": r["name"], "status": r["status"], "seconds": r["seconds"],
                              **speed_brief(r.get("result", {}))} for r in data["runs"]]}
        if step["read"] == "tables":
            rows = [json.loads(line) for line in open(step["json"])]
            return {"table_rows": {st: sum(r["status"] == st for r in rows) for st in ("ok", "timeout", "skipped")}}
        if step["read"] == "bench":
            data = json.loads(Path(step["json"]).read_text())
            return {k: data[k] for k in ("rows", "read_rows", "time_rows", "skipped", "complete") if k in data}
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
    return {}


def speed_brief(result: dict) -> dict:
    """A speed run's figures for the record: a profile's shares and counts, a bench's rows."""
    if "shares" in result:
        return {k: result[k] for k in ("compile", "step_ms", "kernels_per_step", "host_syncs_per_step",
                                       "graph_breaks", "recompiles", "shares")}
    return {"rows": [{k: row.get(k) for k in ("config", "compile", "micro", "tokens_per_s", "mfu_nominal",
                                               "mfu_executed", "peak_gib")} for row in result.get("rows", [])]}


def compare(runs: Path) -> int:
    """ds_compare: fused vs torch bookkeeping give the same losses and iterations, per ZeRO stage."""
    out, ok = {}, True
    for zero in (1, 3):
        if not (runs / f"ds_zero{zero}_torch").exists():
            out[f"zero{zero}"] = "no fused twin (a CPU: the fused bookkeeping needs a GPU)"
            continue
        pair = []
        for name in (f"ds_zero{zero}", f"ds_zero{zero}_torch"):
            rows = [json.loads(line) for line in open(runs / name / "metrics.jsonl")]
            pair.append([r for r in rows if r["kind"] == "train"])
        a, b = pair
        dloss = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
        same_iters = all({n: s["iters_mean"] for n, s in x["layers"].items()}
                         == {n: s["iters_mean"] for n, s in y["layers"].items()} for x, y in zip(a, b))
        out[f"zero{zero}"] = {"steps": len(a), "max_loss_diff": dloss, "same_iterations": same_iters}
        ok = ok and len(a) == len(b) and dloss < 5e-2 and same_iters
    print(json.dumps({**out, "ok": ok}))
    return 0 if ok else 1


def summary(out: Path, records: list[dict], budget: float, started: float) -> None:
    env = next((r.get("result", {}) for r in records if r["step"] == "env" and r["status"] == "ok"), {})
    lines = [f"# GPU checklist ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"device: {env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
             f"triton {env.get('triton', '?')}, deepspeed {env.get('deepspeed', '?')}", "",
             f"kernels: {env.get('kernels', '?')}", "",
             f"budget {budget:g} s, used {time.monotonic() - started:.0f} s", "",
             "| step | status | s | result |", "| --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['step']} | {r['status']} | {r.get('seconds', 0):.0f} | {brief(r)} |")
    for r in records:
        if r["step"] == "recipes" and r.get("result", {}).get("rows"):
            lines += ["", "| config | tokens/s | MFU nominal | MFU executed | peak GiB | plan GiB | iters |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for row in r["result"]["rows"]:
                lines.append(f"| {row['config']} | {row['tokens_per_s']:,.0f} | {pct(row.get('mfu_nominal'))} | "
                             f"{pct(row.get('mfu_executed'))} | {row['peak_gib']:.2f} | "
                             f"{fmt(row.get('plan_gib'))} | {row['iters']} |")
    for r in records:
        if r["step"] == "speed" and r.get("result", {}).get("runs"):
            lines += ["", "| speed run | status | compile | ms/step | kernels/step | syncs/step | breaks | "
                      "tokens/s | MFU executed | shares |", "|" + " --- |" * 10]
            for run in r["result"]["runs"]:
                shares = " ".join(f"{k} {v:.0%}" for k, v in run.get("shares", {}).items() if v >= 0.01)
                for row in run.get("rows") or [{}]:
                    lines.append(f"| {run['name']} | {run['status']} | {row.get('compile', run.get('compile', '-'))} | "
                                 f"{fmt(run.get('step_ms'))} | {fmt(run.get('kernels_per_step'))} | "
                                 f"{run.get('host_syncs_per_step', '-')} | {run.get('graph_breaks', '-')} | "
                                 f"{fmt(row.get('tokens_per_s'))} | {pct(row.get('mfu_executed'))} | {shares} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def brief(r: dict) -> str:
    res = r.get("result", {})
    if r["status"] != "ok":
        return (r.get("why") or r.get("tail", "")[-160:]).replace("\n", " / ").replace("|", "/")
    if "losses" in res:
        return f"losses {' '.join(f'{x:.4f}' for x in res['losses'][-3:])}, {res['memory_gib']:.2f} GiB"
    if "pytest" in res:
        return res["pytest"].replace("|", "/")
    if r["step"] == "ds_compare":
        return ", ".join(f"{k}: dloss {v['max_loss_diff']:.1e} same iters {v['same_iterations']}"
                         if isinstance(v, dict) else f"{k}: {v}" for k, v in res.items() if k != "ok")
    if "rows" in res:
        return f"{len(res['rows'])} rows" + (f", skipped {', '.join(res['skipped'])}" if res.get("skipped") else "")
    if "kernels" in res:
        return res["gpu"]
    return ", ".join(f"{k}: {len(v) if isinstance(v, list) else v}" for k, v in res.items())[:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole checklist's deadline (s)")
    ap.add_argument("--out", default=str(ROOT / "gpu_report"), help="the report folder (emptied first)")
    ap.add_argument("--python", default=sys.executable, help="the Python of the steps")
    ap.add_argument("--only", help="run only these steps (comma-separated names; the others are recorded as skipped)")
    ap.add_argument("--compare", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    plan = plan_steps("python", True, Path("."))
    names = [s["name"] for s in plan]
    only = set(args.only.split(",")) if args.only else {s["name"] for s in plan if not s.get("opt_in")}
    if only - set(names):
        ap.error(f"--only: unknown step(s) {', '.join(sorted(only - set(names)))}; the steps are {', '.join(names)}")
    if args.compare:
        return compare(Path(args.compare))
    started = time.monotonic()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    import torch
    gpu = torch.cuda.is_available()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    records: list[dict] = []
    results = out / "results.jsonl"
    print(f"gpu_checklist: {'GPU' if gpu else 'CPU sizes (no GPU)'}, budget {args.budget_s:g} s, report in {out}",
          flush=True)
    for step in plan_steps(args.python, gpu, out):
        if step.get("opt_in") and step["name"] not in only:
            continue                                    # run only when named (--only tables)
        left = args.budget_s - (time.monotonic() - started) - RESERVE_S
        record: dict = {"step": step["name"], "cmd": " ".join(map(str, step["cmd"]))}
        if step["name"] not in only:
            record.update(status="skipped", seconds=0.0, why="not in --only")
        elif left < MIN_STEP_S:
            record.update(status="skipped", seconds=0.0, why=f"the budget of {args.budget_s:g} s is spent")
        else:
            bound = min(step["cap"], left)
            cmd = list(step["cmd"])
            if step.get("budget_flag"):          # the bench stops starting runs in time, keeping its rows
                cmd += ["--budget-s", f"{max(bound - 30, bound / 2):.0f}"]
            log = out / "logs" / f"{step['name']}.log"
            rc, seconds = run_bounded(cmd, bound, log, env)
            record.update(seconds=round(seconds, 1), log=str(log.relative_to(out)))
            if rc is None:
                record.update(status="timeout", why=f"killed at its bound of {bound:.0f} s", tail=tail(log))
            elif rc != 0:
                record.update(status="fail", rc=rc, tail=tail(log, 15))
            else:
                record.update(status="ok", result=read_result(step, log))
            if step.get("json") and rc is None and Path(step["json"]).exists():
                record["result"] = read_result(step, log)      # the rows it wrote before the kill
        records.append(record)
        with open(results, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        summary(out, records, args.budget_s, started)
        print(f"  {record['step']:<15} {record['status']:<8} {record.get('seconds', 0):6.1f} s  {brief(record)}",
              flush=True)
    records = [r for r in records if r.get("why") != "not in --only"]
    bad = [r["step"] for r in records if r["status"] != "ok"]
    print(f"gpu_checklist: {len(records) - len(bad)}/{len(records)} ok in {time.monotonic() - started:.0f} s"
          + (f"; not ok: {', '.join(bad)}" if bad else "") + f"; {out / 'summary.md'}", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
