"""The seeds' own tables in minutes of one GPU (issue 50), each table a step with its own time cap, each row
appended to ``<out>/results.jsonl`` as it finishes and ``<out>/tables.md`` rewritten after it, so a timeout
(of a table, of the budget, of the whole command) leaves every finished row. In this order:

  state_tracking  seed 002 (App. E.2, Figs. 2a and 4): S3 and A5 trained at length 16 with the authors' data
                  conventions (experiments/state_tracking_rerun.py: BOS, their share of length-2 words, every
                  position scored), accuracy of the state after n elements at n = 16-256 (evaluation cap 256):
                  FP-Mamba 1L (preset authors_state_tracking, init: authors), Mamba 1L and 2L, FP-Mamba2
                  (the authors' solver constants); Householder r = 4; 2 seeds
  a5              seed 004 (Fig. 3; Table 6): A5 at length 32, accuracy at n = 8-128: FPRM's looped core (pre-norm
                  + residual scaling at a1 = a2 = 0.5, conv, deep supervision in windows of 4, fixed-point halting,
                  cap 128 in training and 256 in evaluation) against 2 attention blocks of equal parameters; 2 seeds
  induction       seed 000 (Sec. 3.1, Fig. 2b; issue 30's sweep, experiments/induction.py): FPSA 1L (per token and
                  per head), FPSA-LH 1L, attention 1L and 2L, trained on K = 0-4 distractors, accuracy at K = 0-24

    PYTHONPATH=. python experiments/gpu_tables.py --budget-s 420 --out gpu_tables            # the GPU call
    PYTHONPATH=. python experiments/gpu_tables.py --budget-s 60 --out /tmp/t --device cpu    # CPU sizes (CI)

A table's cap is its share (--shares) of what is left of the budget; a row's, what is left of its table over
the rows left. A row trains for its time: after WARM steps it times TIMED steps and fixes its step count (at
most the authors' budget), so the learning-rate schedule fits the steps it runs; it stops early if a step
grows slower, and its record says so. Past a table's cap (+ GRACE) the row in progress is recorded as a
timeout and the rest as skipped. On CUDA the models train under bf16 autocast with the fused solver
bookkeeping (``solver.bookkeeping: auto``), eager (``--compile blocks`` and ``--chunk K``: not measured at
these sizes, off by default); on CPU fp32 at CPU sizes (``--quick`` gives those on any device). Synthetic data
is drawn on the device (experiments/device_tasks.py). The authors' budgets and what fits: experiments/README.md.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext, redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.common import eval_aligned, small_model, table  # noqa: E402
from experiments.device_tasks import GroupWords, InductionBatches  # noqa: E402
from experiments.induction import FPSA_SOLVER, TRAIN_K  # noqa: E402
from experiments.induction import MODELS as INDUCTION_MODELS
from experiments.state_tracking import FP_SOLVER  # noqa: E402
from fpscale.data.synthetic import authors_short_fraction, group_elements  # noqa: E402
from fpscale.layers.fpmamba import AUTHORS_SOLVER  # noqa: E402

TABLES = ("state_tracking", "a5", "induction")
SHARES = {"state_tracking": 0.5, "a5": 0.25, "induction": 0.25}
WARM, TIMED, GRACE, RESERVE = 3, 5, 10.0, 3.0    # untimed steps, timed steps, s past a cap, s kept for the end
EVAL_SHARE = 0.2                                  # of a row's time kept for its evaluation
# the authors' budgets (training steps x batch) and where their papers state them
AUTHORS = {"state_tracking": {"steps": 127_140, "batch": 512, "source": "seed 002 App. E.2: 5 epochs x 25,428 "
                              "iterations of batch 512 (65.1M words of length 16), lr 1e-4, AdamW, wd 0.01, clip 1"},
           "a5": {"steps": None, "batch": 1024, "source": "seed 004 Table 6: FPRM 20 epochs of global batch 1024 "
                  "(the data set's size is not stated), lr 1e-3, hidden 512"},
           "induction": {"steps": None, "batch": None, "source": "seed 000 Sec. 3.1 states no training budget; "
                         "issue 30: the budget at which attention 2L first learns plain induction"}}


def sizes(full: bool) -> dict:
    """Geometry per table: the seeds' on a GPU (``full``), a few seconds a row on CPU otherwise."""
    if full:
        return {"state_tracking": dict(d=512, heads=8, d_state=16, headdim=64, batch=512, lr=1e-3, n_eval=512,
                                       lengths=[16, 32, 64, 128, 256], eval_cap=256, warmup=100),
                "a5": dict(d=512, heads=8, batch=1024, lr=1e-3, n_eval=512, lengths=[8, 16, 32, 64, 96, 128],
                           cap=128, eval_cap=256, warmup=100),
                "induction": dict(d=256, heads=4, vocab=32, length=64, batch=250, lr=1e-3, n_eval=1000,
                                  ks=[0, 2, 4, 8, 16, 24], warmup=100)}
    return {"state_tracking": dict(d=32, heads=2, d_state=4, headdim=8, batch=8, lr=3e-3, n_eval=16, lengths=[16, 32],
                                   eval_cap=32, warmup=1),
            "a5": dict(d=32, heads=2, batch=8, lr=3e-3, n_eval=16, lengths=[8, 32], cap=8, eval_cap=16, warmup=1),
            "induction": dict(d=32, heads=2, vocab=16, length=24, batch=10, lr=1e-3, n_eval=20, ks=[0, 4], warmup=1)}


def rows_of(name: str, s: dict, seeds: list[int]) -> list[dict]:
    """The rows of a table, in the order they run (every model of a seed before the next seed)."""
    if name == "state_tracking":
        mix = {"mixer": "householder", "mixer_rank": 4, "d_state": s["d_state"]}
        mamba = {"type": "fpmamba", "mixer": "none", "y_feedback": False, "d_state": s["d_state"]}
        one = {**FP_SOLVER, "max_iter": 1, "eval_max_iter": 1}
        deep = {**FP_SOLVER, "eval_max_iter": s["eval_cap"]}
        models = {"FP-Mamba 1L (authors_state_tracking, init authors)":
                  ([{"type": "fpmamba", "preset": "authors_state_tracking", "init": "authors", **mix}], deep),
                  "Mamba 1L": ([mamba], one), "Mamba 2L": ([{**mamba, "repeat": 2}], one),
                  "FP-Mamba2 (authors' solver)": ([{"type": "fpmamba2", "headdim": s["headdim"],
                                                    "solver": {**AUTHORS_SOLVER, "eval_max_iter": s["eval_cap"]},
                                                    **mix}], deep)}
        return [dict(model=m, task=g, seed=seed, layers=ls, solver=sv) for seed in seeds for g in ("s3", "a5")
                for m, (ls, sv) in models.items()]
    if name == "a5":
        fprm = {"max_iter": s["cap"], "eval_max_iter": s["eval_cap"], "tol": 0.1, "stop_quantile": 0.25,
                "patience": 3, "decay": 0.5, "eta_min": 0.05, "backward": "phantom", "phantom_steps": 4}
        models = {"FPRM looped core (DS window 4)": ([{"type": "looped", "core_blocks": 2, "a1_init": 0.5,
                                                       "a2_init": 0.5, "conv": True,
                                                       "deep_supervision": {"window": 4}}], fprm),
                  "transformer, 2 attention blocks": ([{"type": "attn", "repeat": 2}], {})}
        return [dict(model=m, task="a5", seed=seed, layers=ls, solver=sv) for seed in seeds
                for m, (ls, sv) in models.items()]
    order = ["attention 2L", "FPSA 1L", "attention 1L", "FPSA 1L per head", "FPSA-LH 1L"]
    return [dict(model=m, task="induction", seed=seeds[0], layers=INDUCTION_MODELS[m], solver=FPSA_SOLVER)
            for m in order]


def tasks(name: str, row: dict, s: dict, device) -> tuple:
    """(training task, vocab, training length, {evaluation point: task})."""
    if name == "induction":
        train = InductionBatches(s["vocab"], s["length"], device, seed=1 + row["seed"], mixed=tuple(TRAIN_K))
        evals = {k: InductionBatches(s["vocab"], s["length"], device, seed=50_000 + k, distractors=k) for k in s["ks"]}
        return train, s["vocab"], s["length"], evals
    g = row["task"]
    if name == "state_tracking":           # the authors' conventions (state_tracking_rerun.task)
        train = GroupWords(g, 16, device, seed=1 + row["seed"], start_token=True,
                           short_fraction=authors_short_fraction(g), score_specials=True)
        evals = {n: GroupWords(g, n, device, seed=10_000 + n, start_token=True) for n in s["lengths"]}
        return train, len(group_elements(g)) + 2, 17, evals
    train = GroupWords(g, 32, device, seed=1 + row["seed"])
    return train, len(group_elements(g)), 32, {n: GroupWords(g, n, device, seed=10_000 + n) for n in s["lengths"]}


class TableTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TableTimeout()


def train_for(model, task, seconds: float, batch: int, lr: float, warmup: int, max_steps: int | None,
              constant: bool, amp) -> dict:
    """AdamW (fpscale.train.optim, as experiments.common.train_aligned) for what fits in ``seconds``: the
    step count is fixed after WARM + TIMED steps (at most ``max_steps``); linear warm-up (``warmup`` steps, at most
    a tenth of the run once its length is known), then cosine to lr/10 (``constant``: flat). Returns steps,
    planned steps, wall, seconds per step, final loss."""
    from fpscale.train.optim import AdamW
    from fpscale.train.schedule import lr_at
    from fpscale.train.trainer import param_groups
    opt = AdamW(param_groups(model, 0.01), lr=lr, betas=(0.9, 0.95))
    model.train()
    total, losses, t0, t_timed, per_step, cut = 1 << 30, [], time.perf_counter(), 0.0, float("nan"), False
    step = 0
    while step < min(total, max_steps or total):
        if step == WARM:
            t_timed = time.perf_counter()
        if step == WARM + TIMED:
            per_step = (time.perf_counter() - t_timed) / TIMED
            total = max(step + 1, int((seconds - (time.perf_counter() - t0)) / per_step) + step)
            warmup = min(warmup, max(step + 1, total // 10))     # a short run warms up over a tenth of it
        elif step > WARM + TIMED and time.perf_counter() - t0 > 1.3 * seconds + 2:
            cut = True                     # slower than timed (the solver's iterations grew): stop here
            break
        model.set_step(step)
        for group in opt.param_groups:
            group["lr"] = lr if constant and step >= warmup else lr_at(step, lr, lr / 10, warmup, total)
        inputs, targets = task.examples(range(batch))
        with amp():
            loss = model(inputs, targets=targets)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.skip_next = not math.isfinite(float(gn))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(model.last_losses.get("ce", loss).detach()))
        step += 1
    wall = time.perf_counter() - t0
    return {"steps": step, "steps_planned": min(total, max_steps or total) if total < 1 << 30 else step,
            "train_s": round(wall, 2), "s_per_step": per_step if per_step == per_step else wall / max(step, 1),
            "cut_by_time": cut, "final_loss": float(np.mean(losses[-20:])) if losses else float("nan")}


def run_row(name: str, row: dict, s: dict, args, seconds: float, deadline: float) -> dict:
    train, vocab, train_len, evals = tasks(name, row, s, args.device)
    max_len = max(list(evals) if name != "induction" else [s["length"]]) + (1 if name == "state_tracking" else 0)
    solver = {**row["solver"], **({"chunk": args.chunk} if args.chunk and row["solver"] else {})}
    model, _ = small_model(vocab, s["d"], row["layers"], solver, n_heads=s["heads"], max_seq_len=max_len,
                           seed=row["seed"])
    model.to(args.device)
    if args.compile != "none":
        from fpscale.parallel.compile import apply_compile
        apply_compile(model, args.compile)
    cuda = torch.device(args.device).type == "cuda"

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    authors = AUTHORS[name]
    max_steps = None
    if authors["steps"]:                   # never more words than the authors trained on
        max_steps = authors["steps"] * authors["batch"] // s["batch"]
    rec = train_for(model, train, seconds * (1 - EVAL_SHARE), s["batch"], s["lr"], s["warmup"], max_steps,
                    name == "induction", amp)
    acc, iters, t0 = {}, {}, time.perf_counter()
    with amp():
        for n, task in evals.items():
            if time.monotonic() > deadline:
                break                          # the table's cap: the points left are not evaluated
            ev = eval_aligned(model, task, s["n_eval"], batch=min(s["n_eval"], 256))   # the solvers' eval caps
            acc[str(n)] = ev["last_acc"]
            iters[str(n)] = float(np.median(ev["iters"])) if ev["iters"] else 1.0
    words = rec["steps"] * s["batch"]
    out = {**rec, "eval_s": round(time.perf_counter() - t0, 2), "params": model.num_params(), "acc": acc,
           "iters": iters, "words": words, "tokens": words * train_len,
           "authors_budget": ({"steps": authors["steps"], "words": authors["steps"] * authors["batch"],
                               "fraction": words / (authors["steps"] * authors["batch"]),
                               "est_s_at_this_rate": authors["steps"] * authors["batch"] / s["batch"]
                               * rec["s_per_step"]} if authors["steps"] else None)}
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def estimate(names: list[str], out: str, launch_us: float = 10.0, tflops: float = 300.0,
             count_batch: int = 8) -> None:
    """``--estimate``: per model of each table at the GPU geometry, one training step on this machine counted
    (aten ops dispatched, matmul FLOPs: device-independent), and the H200 time of the authors' budget it implies:
    a step costs at least ops x ``launch_us`` (eager launches, host-bound at these sizes) and FLOPs / ``tflops``
    (a third of the H200's dense bf16 peak); the larger is the estimate. Counted at ``count_batch`` words (the
    ops do not depend on the batch), the FLOPs scaled to the table's batch. CPU ops include the torch solver
    bookkeeping that the fused kernels replace on CUDA (~40 ops per iteration against 4) and the chunked PyTorch
    scan (one Triton kernel each way on CUDA): the launch-bound figure is an upper bound, the FLOP-bound a lower."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    geometry, rows = sizes(True), []
    for name in names:
        s = geometry[name]
        for row in [r for r in rows_of(name, s, [0]) if r["task"] != "s3"]:      # A5: S3's step, a smaller vocab
            train, vocab, train_len, _ = tasks(name, row, s, "cpu")
            model, _ = small_model(vocab, s["d"], row["layers"], row["solver"], n_heads=s["heads"],
                                   max_seq_len=train_len, seed=0)
            inputs, targets = train.examples(range(count_batch))     # ops do not grow with the batch; FLOPs do
            Count.n, t0 = 0, time.perf_counter()
            with Count(), FlopCounterMode(display=False) as flops:
                model(inputs, targets=targets).backward()
            ops = Count.n + 12 * len(list(model.parameters()))
            fl = flops.get_total_flops() * s["batch"] / count_batch
            it = max([st.iterations for st in model.layer_stats().values()] or [1])
            step_s = max(ops * launch_us * 1e-6, fl / (tflops * 1e12))
            a = AUTHORS[name]
            steps = a["steps"] and a["steps"] * a["batch"] // s["batch"]
            rows.append({"table": name, "model": row["model"], "params": model.num_params(), "batch": s["batch"],
                         "iterations": int(it), "ops": ops, "gflop": fl / 1e9, "cpu_s": time.perf_counter() - t0,
                         "est_ms_per_step": step_s * 1e3, "flop_ms": fl / (tflops * 1e12) * 1e3,
                         "authors_steps": steps, "est_authors_s": steps and steps * step_s})
            print(rows[-1], flush=True)
    table(["table", "model", "params", "batch", "iters", "ops/step", "GFLOP/step", "FLOP-bound ms", "est ms/step",
           "authors' steps", "est s (authors)"], [[r["table"], r["model"], r["params"], r["batch"], r["iterations"],
                                                   r["ops"], r["gflop"], r["flop_ms"], r["est_ms_per_step"],
                                                   r["authors_steps"] or "not stated",
                                 r["est_authors_s"] or "-"] for r in rows],
          f"one training step at the GPU geometry, counted on this machine; est = max(ops x {launch_us:g} us, "
          f"FLOP / {tflops:g} TFLOP/s)")
    with open(os.path.join(out, "estimate.json"), "w") as fh:
        json.dump(rows, fh, indent=1, default=float)


def commit(given: str) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_tables(out: str, records: list[dict], header: dict) -> None:
    """tables.md from every record so far: one Markdown table per table, the papers' numbers beside in
    experiments/README.md."""
    lines = [f"# The seeds' tables (experiments/gpu_tables.py; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", f"device {header['device']}, torch {header['torch']}, precision {header['precision']}, "
             f"commit {header['commit']}, budget {header['budget_s']:g} s, sizes {header['sizes']}", ""]
    for name in TABLES:
        recs = [r for r in records if r["table"] == name]
        if not recs:
            continue
        points = sorted({int(p) for r in recs for p in r.get("acc", {})})
        head = ["model", "task", "seed", "status", "params", "steps", "words"] + [
            (f"K={p}" if name == "induction" else f"acc@{p}") for p in points] + ["iters@last", "train s", "loss"]
        rows = [[r["model"], r["task"], r["seed"], r["status"], r.get("params", ""), r.get("steps", ""),
                 r.get("words", "")] + [r.get("acc", {}).get(str(p), "") for p in points] +
                [list(r.get("iters", {}).values())[-1] if r.get("iters") else "",
                 r.get("train_s", ""), r.get("final_loss", "")] for r in recs]
        with redirect_stdout(io.StringIO()):          # common.table also prints: once per row is enough
            text = table(head, rows)
        lines += [f"## {name}: {AUTHORS[name]['source']}", "", text, ""]
    with open(os.path.join(out, "tables.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def run_table(name: str, rows: list[dict], cap: float, min_row_s: float, run, emit, grace: float = GRACE) -> None:
    """Run ``rows`` within ``cap`` seconds: ``run(row, seconds, deadline)`` -> its record; ``emit(row, status,
    record)`` writes each. A row starts only with ``min_row_s`` left; past cap + GRACE (SIGALRM) the row in
    progress is a timeout and the rest are skipped (``grace``: GRACE)."""
    deadline = time.monotonic() + cap
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, cap + grace)
    try:
        for i, row in enumerate(rows):
            left = deadline - time.monotonic()
            if left < min_row_s:
                emit(row, "skipped", {"why": f"table {name}'s cap of {cap:.0f} s is spent"})
                continue
            t0 = time.monotonic()
            try:
                emit(row, "ok", run(row, left / (len(rows) - i), deadline))
            except TableTimeout:
                signal.setitimer(signal.ITIMER_REAL, 0)
                emit(row, "timeout", {"why": f"killed at table {name}'s cap of {cap:.0f} s + {grace:.0f} s",
                                      "seconds": round(time.monotonic() - t0, 1)})
                for rest in rows[i + 1:]:
                    emit(rest, "skipped", {"why": f"table {name} timed out"})
                return
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default=",".join(TABLES), help=f"of {', '.join(TABLES)} (run in this order)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run's deadline (s)")
    ap.add_argument("--out", required=True, help="folder for results.jsonl and tables.md (appended, rewritten)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CPU sizes on any device (a pipeline check)")
    ap.add_argument("--seeds", default="0,1", help="seeds of state_tracking and a5 (induction: the first)")
    ap.add_argument("--shares", default="", help="name=share,... of the budget (default state_tracking=0.5, "
                                                 "a5=0.25, induction=0.25)")
    ap.add_argument("--compile", default="none", choices=["none", "blocks"], help="train.compile's modes")
    ap.add_argument("--chunk", type=int, default=0, help="solver.chunk for the looped layers (0: off)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--estimate", action="store_true",
                    help="count a step of each model at the GPU geometry here and estimate the authors' budgets on "
                         "an H200; no training")
    ap.add_argument("--commit", default="", help="the commit to record (default: git rev-parse, where .git is)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    names = [t for t in args.tables.split(",") if t]
    bad = [t for t in names if t not in TABLES]
    if bad:
        ap.error(f"--tables: unknown {', '.join(bad)}; the tables are {', '.join(TABLES)}")
    shares = {**SHARES, **{k: float(v) for k, v in (kv.split("=") for kv in args.shares.split(",") if kv)}}
    if args.threads:
        torch.set_num_threads(args.threads)
    full = torch.device(args.device).type == "cuda" and not args.quick
    geometry = sizes(full)
    os.makedirs(args.out, exist_ok=True)
    header = {"device": torch.cuda.get_device_name(0) if torch.device(args.device).type == "cuda" else "cpu",
              "torch": torch.__version__, "precision": "bf16 autocast" if torch.device(args.device).type == "cuda"
              else "fp32", "commit": commit(args.commit), "budget_s": args.budget_s,
              "sizes": "the seeds'" if full else "CPU (smoke)", "compile": args.compile, "chunk": args.chunk}
    path = os.path.join(args.out, "results.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.estimate:
        estimate(names, args.out)
        return 0
    print(f"gpu_tables: {header}, tables {names}", flush=True)
    for i, name in enumerate(names):
        left = args.budget_s - (time.monotonic() - started) - RESERVE
        cap = max(0.0, left * shares[name] / sum(shares[n] for n in names[i:]))
        s = geometry[name]

        def emit(row, status, rec, name=name, s=s):
            r = {"table": name, "model": row["model"], "task": row["task"], "seed": row["seed"], "status": status,
                 **rec, "config": {"layers": row["layers"], "solver": row["solver"], **s}, **header}
            records.append(r)
            with open(path, "a") as fh:
                fh.write(json.dumps(r, default=float) + "\n")
            write_tables(args.out, records, header)
            accs = " ".join(f"{k}:{v:.2f}" for k, v in rec.get("acc", {}).items())
            print(f"  {name} | {row['model']} | {row['task']} seed {row['seed']}: {status} "
                  f"{rec.get('steps', '')} steps {accs} {rec.get('why', '')}", flush=True)

        run_table(name, rows_of(name, s, seeds), cap, 3.0 if full else 0.5,
                  lambda row, sec, dl, name=name, s=s: run_row(name, row, s, args, sec, dl), emit)
    ok = sum(r["status"] == "ok" for r in records)
    print(f"gpu_tables: {ok}/{len(records)} rows ok in {time.monotonic() - started:.0f} s; "
          f"{os.path.join(args.out, 'tables.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
