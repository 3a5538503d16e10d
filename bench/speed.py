"""The GPU checklist's ``speed`` step (issue 46): where a training step's time goes and what compiling buys,
per recipe, each run under its own deadline, every result in the report folder as soon as it exists.

    python bench/speed.py --out gpu_report/speed --budget-s 460        # a GPU: the recipes as they are
    python bench/speed.py --out /tmp/speed --cpu-sizes                  # CPU: the same runs at small width

In order (the most telling first; what the budget leaves out is listed under ``skipped``):
  1. bench/profile_step.py for 125m_attn eager (``train.compile: none``) and compiled (``auto``)
  2. bench/gpu.py eager vs compiled (``--compile none auto``) for every 125m recipe and 140m_attractor, at
     micro-batch ``--micro`` (8: the table of docs/gpu.md), one config per call
  3. bench/profile_step.py for 125m_fpsa and 125m_fpmamba (``--profiles``), eager and compiled
Writes ``<out>/speed.json`` after every run (``runs``: name, status, seconds, the JSON it wrote; ``complete``),
and each run's own JSON (and the profiles' Chrome traces, ``--traces``) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["125m_attn", "125m_fpsa", "125m_looped", "125m_epsilon", "125m_mamba1", "125m_mamba", "125m_fpmamba",
           "125m_fpmamba_authors", "140m_attractor"]
SMALL = ["model.d_model=64", "model.n_heads=2", "data.seq_len=64", "model.vocab_size=512", "solver.forward.max_iter=8",
         "solver.forward.eval_max_iter=8"]


def plan(args, out: Path) -> list[dict]:
    py = sys.executable
    small = ["--small"] if args.cpu_sizes else []

    def profile(config: str, mode: str) -> dict:
        name = f"profile_{config}_{mode}"
        cmd = [py, "bench/profile_step.py", "--config", f"configs/{config}.yaml", *small, "--json",
               str(out / f"{name}.json"), *(["--trace", str(out / f"{name}.trace.json")] if args.traces else []),
               f"train.compile={mode}", *args.override]
        return {"name": name, "cmd": cmd, "json": out / f"{name}.json", "cap": args.cap_s}

    def bench(config: str) -> dict:
        name = f"gpu_{config}"
        cmd = [py, "bench/gpu.py", "--configs", f"configs/{config}.yaml", "--compile", "none", "auto", "--no-fit",
               "--no-sdpa-twin", "--out", str(out / f"{name}.json")]
        cmd += (["--micro", "1", "--warmup", "1", "--steps", "1", "--override", *SMALL, *args.override]
                if args.cpu_sizes else
                ["--micro", str(args.micro), "--warmup", "2", "--steps", "4",
                 *(["--override", *args.override] if args.override else [])])
        return {"name": name, "cmd": cmd, "json": out / f"{name}.json", "cap": args.cap_s}

    runs = [profile("125m_attn", "none"), profile("125m_attn", "auto")]
    runs += [bench(c) for c in args.configs]
    runs += [profile(c, m) for c in args.profiles for m in ("none", "auto")]
    return runs


def run_bounded(cmd: list[str], seconds: float, log: Path) -> int | None:
    """Exit status, or None when killed at ``seconds`` (its whole process group)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder of the results (created)")
    ap.add_argument("--budget-s", type=float, default=460.0, help="start no run after this many seconds")
    ap.add_argument("--cap-s", type=float, default=150.0, help="one run's deadline (s)")
    ap.add_argument("--micro", type=int, default=8, help="bench/gpu.py's micro-batch (GPU)")
    ap.add_argument("--configs", nargs="*", default=RECIPES, help="bench/gpu.py's recipes (names in configs/)")
    ap.add_argument("--profiles", nargs="*", default=["125m_fpsa", "125m_fpmamba"],
                    help="the recipes profiled after the bench runs (125m_attn's profiles come first)")
    ap.add_argument("--cpu-sizes", action="store_true", help="small width, one step (CI, a CPU)")
    ap.add_argument("--traces", action="store_true", help="also write the profiles' Chrome traces")
    ap.add_argument("--override", nargs="*", default=[], help="config overrides for every run")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start, records, skipped = time.monotonic(), [], []

    def save(done: bool) -> None:
        tmp = out / "speed.json.tmp"
        tmp.write_text(json.dumps({"runs": records, "skipped": skipped, "complete": done}, indent=2))
        os.replace(tmp, out / "speed.json")

    for r in plan(args, out):
        left = args.budget_s - (time.monotonic() - start)
        if left < 5:
            skipped.append(r["name"])
            save(False)
            continue
        t0 = time.monotonic()
        rc = run_bounded(r["cmd"], min(r["cap"], left), out / f"{r['name']}.log")
        rec = {"name": r["name"], "cmd": " ".join(r["cmd"]), "seconds": round(time.monotonic() - t0, 1),
               "status": "ok" if rc == 0 else ("timeout" if rc is None else f"fail (rc {rc})")}
        if r["json"].exists():
            rec["result"] = json.loads(r["json"].read_text())
        records.append(rec)
        print(f"  {r['name']:<34} {rec['status']:<10} {rec['seconds']:6.1f} s", flush=True)
        save(False)
    save(True)
    bad = [r["name"] for r in records if r["status"] != "ok"]
    print(f"speed: {len(records) - len(bad)}/{len(records)} ok, skipped {len(skipped)}; {out / 'speed.json'}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
