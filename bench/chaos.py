"""Chaos: a training run killed again and again, at random moments on random ranks, resumed each
time with ``resume: auto``, against the same run left alone.

    python bench/chaos.py                                   # zero1 (2 processes), tp2xdp2 (4), 8 faults each
    python bench/chaos.py --layouts tp2xdp2 --interruptions 20 --steps 60 --seed 11
    python bench/chaos.py --layouts zero3 train.precision=bf16 --out bench/results/chaos_bf16.json

Every interruption is a fault (``FPSCALE_FAULT``, fpscale/train/faults.py): SIGKILL (3 in 4) or
SIGTERM for a random rank, at a random phase (a training step, a validation, a save, the hashing
of a save) of a random step ahead of the resume point, after a random delay within about the
phase's length (``DELAY_S``), so the signal comes from a timer thread wherever the run is by then:
inside a collective, a write, a rename; the line each launch prints says where it landed. The
launcher (torchrun) ends the job; the next launch resumes; after the last fault the run trains
to the end. Checked after every launch: every published checkpoint passes its
manifest, and the steps recomputed (last step completed minus the step resumed from) never
exceed ``train.save_interval``. At the end the losses, gradient norms, validation losses, final
weights and data position must equal the uninterrupted run's bit for bit (the layout never
changes). The seed is printed first; the same seed draws the same faults (where a timed signal
lands, and so the next resume point, can still vary with the machine's speed).

Prints a table per layout (one row per launch) and a summary, and writes bench/results/chaos.json.
tests/train/test_chaos.py runs ``run_chaos`` with 5 faults per layout.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYOUTS = {"zero1": (2, ["parallel.zero_stage=1"]), "zero3": (2, ["parallel.zero_stage=3"]),
           "tp2": (2, ["parallel.tp=2", "parallel.zero_stage=1"]),
           "tp2xdp2": (4, ["parallel.tp=2", "parallel.zero_stage=1"])}
BASE = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32", "model.max_seq_len=32",
        "train.micro_batch=4", "train.global_batch=16", "train.warmup=2", "train.log_interval=1",
        "train.eval_batches=2", "train.keep_last=2", "train.save_interval_minutes=0", "train.export_final=false",
        "parallel.timeout_s=15", "solver.forward.stop_quantile=0.0"]
PHASES = ("step", "val", "save", "hash")
DELAY_S = {"step": 0.1, "val": 0.1, "save": 0.3, "hash": 0.1}     # about each phase's length here
FAULT_LINE = re.compile(r"fault: (SIG\w+) to rank (\d+) \(pid \d+\) at (\w+) of step (\d+)")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


@dataclass
class Launch:
    fault: str | None            # what was asked (FPSCALE_FAULT)
    hit: str | None              # where the run was when the signal came ("SIGKILL rank 1 at save of step 8")
    exit_code: int
    seconds: float
    resumed_from: int            # the step this launch started from (0: fresh)
    last_step: int               # the last training step it completed (logged)
    recomputed: int = 0          # steps the next launch trains again
    bad_checkpoints: list[str] = field(default_factory=list)


def command(nproc: int, out: str, name: str, layout_args: list[str], steps: int, save_interval: int,
            eval_interval: int, extra: list[str] = ()) -> list[str]:
    from tests.parallel.launch import torchrun_command
    return torchrun_command(nproc, "launch/pretrain.py", "--config", "configs/tiny_mixed.yaml", *BASE, *layout_args,
                            *extra, f"train.steps={steps}", f"train.save_interval={save_interval}",
                            f"train.eval_interval={eval_interval}", f"train.out_dir={out}", f"name={name}")


def run_launch(cmd: list[str], fault: str | None, timeout: float) -> tuple[int, str, float]:
    """(exit code, output, seconds) of one launch with ``fault`` (none: FPSCALE_FAULT empty), in its
    own process group; a launch past ``timeout`` is killed and fails."""
    from tests.parallel.launch import run
    t0 = time.perf_counter()
    proc = run(cmd, timeout, env={"FPSCALE_FAULT": fault or ""}, check=False)
    return proc.returncode, proc.stdout, time.perf_counter() - t0


def records(run_dir: Path, kind: str) -> dict[int, dict]:
    """The last record of each step in metrics.jsonl (a resumed run appends)."""
    rows = map(json.loads, metrics_lines(run_dir))
    return {r["step"]: r for r in rows if r["kind"] == kind}


def metrics_lines(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def bad_checkpoints(run_dir: Path) -> list[str]:
    from fpscale.train.checkpoint import published, verify
    return [f"{folder}: {problem}" for folder in published(str(run_dir / "checkpoints"))
            if (problem := verify(folder))]


def pick_fault(rng: random.Random, resumed: int, steps: int, save_interval: int, eval_interval: int,
               nproc: int) -> str | None:
    """A fault ahead of ``resumed``: a phase that occurs in the next two save intervals (never in
    the last two steps, so that it lands before the run ends)."""
    window = range(resumed + 1, min(steps - 2, resumed + 2 * save_interval) + 1)
    eligible = {"step": list(window), "val": [s for s in window if s % eval_interval == 0],
                "save": [s for s in window if s % save_interval == 0]}
    eligible["hash"] = eligible["save"]
    phases = [p for p in PHASES if eligible[p]]
    if not phases:
        return None
    phase = rng.choice(phases)
    step = rng.choice(eligible[phase])
    sig = "SIGKILL" if rng.random() < 0.75 else "SIGTERM"
    return f"{sig}@{phase}:{step}+{rng.uniform(0.0, DELAY_S[phase]):.3f},rank={rng.randrange(nproc)}"


def compare(ref: Path, got: Path, steps: int) -> list[str]:
    """Where the interrupted run differs from the uninterrupted one: losses, gradient norms and
    validation losses of every step, the final weights, the data position."""
    import torch
    problems = []
    for kind, keys in (("train", ("loss", "grad_norm")), ("val", ("val_loss",))):
        want, have = records(ref, kind), records(got, kind)
        if sorted(want) != sorted(have):
            problems.append(f"{kind} records of steps {sorted(have)}, the reference has {sorted(want)}")
        for step in sorted(set(want) & set(have)):
            for key in keys:
                if want[step][key] != have[step][key]:
                    problems.append(f"{kind} step {step}: {key} {have[step][key]!r} != {want[step][key]!r}")
    tag = f"step_{steps:08d}"
    a, b = ref / "checkpoints" / tag, got / "checkpoints" / tag
    meta_a, meta_b = (json.loads((x / "meta.json").read_text()) for x in (a, b))
    for key in ("step", "consumed_samples", "data_fingerprint"):
        if meta_a[key] != meta_b[key]:
            problems.append(f"final {key}: {meta_b[key]} != {meta_a[key]}")
    shards = sorted(p.name for p in a.glob("mp_rank_*_model_states.pt"))
    for name in shards:
        wa = torch.load(a / name, map_location="cpu", weights_only=False)["module"]
        wb = torch.load(b / name, map_location="cpu", weights_only=False)["module"]
        for key in wa:
            if not torch.equal(wa[key], wb[key]):
                problems.append(f"final weights differ: {name} {key}")
    if not shards:
        problems.append(f"no model shards in {a}")
    return problems


def run_chaos(layout: str, interruptions: int, seed: int, out: str, steps: int = 32, save_interval: int = 4,
              eval_interval: int = 6, timeout: float = 240, log=print, extra: list[str] = ()) -> dict:
    """The uninterrupted run and the interrupted one of ``layout``; returns the report (launches,
    problems, times). The caller asserts on ``report["problems"]``."""
    nproc, layout_args = LAYOUTS[layout]
    rng = random.Random(seed)
    log(f"chaos {layout}: seed {seed}, {interruptions} interruptions, {steps} steps, save every {save_interval}")
    out_dir = Path(out)

    def cmd(name: str) -> list[str]:
        return command(nproc, str(out_dir), name, layout_args, steps, save_interval, eval_interval, list(extra))

    code, text, ref_seconds = run_launch(cmd("reference"), None, timeout)
    if code != 0:
        raise AssertionError(f"the uninterrupted run failed ({code}):\n{text[-3000:]}")
    run_dir = out_dir / "chaos"
    launches: list[Launch] = []
    resumed = 0
    problems: list[str] = []
    for i in range(interruptions + 1):
        fault = pick_fault(rng, resumed, steps, save_interval, eval_interval, nproc) if i < interruptions else None
        before, expected = len(metrics_lines(run_dir)), _newest_step(run_dir)
        code, text, seconds = run_launch(cmd("chaos"), fault, timeout)
        (out_dir / f"launch_{i}.log").write_text(text)        # what each launch printed, kept with the run
        # where the launch began: rank 0's "resumed from" line, else the first step it logged; when rank 0
        # was killed before either (the launcher ends every rank once one dies, and a rank still
        # loading the checkpoint dies of its SIGTERM), there is no evidence and ``expected`` stands
        m = RESUMED.search(text)
        new = [r["step"] for r in map(json.loads, metrics_lines(run_dir)[before:]) if r["kind"] == "train"]
        start = int(m.group(2)) if m else new[0] - 1 if new else expected
        if m and new and new[0] - 1 != start:      # the first step this launch logged says where it began
            problems.append(f"launch {i} printed that it resumed from step {start} but trained step {new[0]} "
                            f"first (log: {out_dir / f'launch_{i}.log'})")
        if start != expected:                    # resume: auto takes the newest complete checkpoint
            problems.append(f"launch {i} resumed from step {start}, but the newest complete checkpoint was "
                            f"step {expected} (log: {out_dir / f'launch_{i}.log'})")
        if launches:
            launches[-1].recomputed = launches[-1].last_step - start
        hit = FAULT_LINE.search(text)
        where = f"{hit.group(1)} rank {hit.group(2)} at {hit.group(3)} of step {hit.group(4)}" if hit else None
        launch = Launch(fault, where, code, seconds, start, max(new) if new else start,
                        bad_checkpoints=bad_checkpoints(run_dir))
        launches.append(launch)
        log(f"  launch {i}: fault {fault or '-'} -> {where or 'none fired'}; exit {code}, {seconds:.1f} s, "
            f"resumed from {start}, reached {launch.last_step}")
        problems += [f"launch {i}: published checkpoint fails its manifest: {b}" for b in launch.bad_checkpoints]
        if fault is None:
            if code != 0:
                problems.append(f"launch {i} (no fault) exited with {code}:\n{text[-3000:]}")
            break
        if code != 0 and not hit:      # it failed before its fault fired: a crash of its own, not the chaos
            problems.append(f"launch {i} exited with {code} before its fault ({fault}) fired:\n{text[-3000:]}")
        if code == 0 and launch.last_step >= steps:
            break                                     # the fault landed after the end: nothing to resume
        resumed = _newest_step(run_dir)
    for i, launch in enumerate(launches[:-1]):
        if launch.recomputed > save_interval:
            problems.append(f"launch {i + 1} recomputed {launch.recomputed} steps, more than train.save_interval = "
                            f"{save_interval} ({launch.hit})")
    if not problems:
        problems += compare(out_dir / "reference", run_dir, steps)
    chaos_seconds = sum(x.seconds for x in launches)
    faults = sum(1 for x in launches if x.fault)
    return {"layout": layout, "seed": seed, "steps": steps, "save_interval": save_interval,
            "interruptions": faults, "fired": sum(1 for x in launches if x.hit),
            "steps_recomputed": sum(x.recomputed for x in launches),
            "max_recomputed": max((x.recomputed for x in launches), default=0),
            "reference_s": ref_seconds, "chaos_s": chaos_seconds,
            "lost_s_per_interruption": (chaos_seconds - ref_seconds) / max(faults, 1),
            "launches": [asdict(x) for x in launches], "problems": problems}


def _newest_step(run_dir: Path) -> int:
    from fpscale.train.checkpoint import newest_complete
    folder = newest_complete(str(run_dir / "checkpoints"))
    return int(folder.rsplit("_", 1)[1]) if folder else 0


def main() -> int:
    from bench.common import print_table, write_json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="zero1,tp2xdp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--interruptions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-interval", type=int, default=4)
    ap.add_argument("--eval-interval", type=int, default=6)
    ap.add_argument("--seed", type=int, default=None, help="default: a new one (printed)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/chaos.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs, e.g. train.precision=bf16")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed} (replay: --seed {seed})")
    reports = []
    for layout in args.layouts.split(","):
        tmp = tempfile.mkdtemp(prefix=f"chaos_{layout}_")
        report = run_chaos(layout, args.interruptions, seed, tmp, args.steps, args.save_interval,
                           args.eval_interval, timeout=600, extra=args.overrides)
        if report["problems"]:
            print(f"kept {tmp} (each launch's output: launch_N.log)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        reports.append(report)
        print_table([{"launch": i, "fault": x["fault"] or "-", "hit": x["hit"] or "-", "exit": x["exit_code"],
                      "s": x["seconds"], "from": x["resumed_from"], "reached": x["last_step"],
                      "recomputed": x["recomputed"]} for i, x in enumerate(report["launches"])],
                    ["launch", "fault", "hit", "exit", "s", "from", "reached", "recomputed"])
        print("problems: " + ("; ".join(report["problems"]) if report["problems"] else "none (bit-identical end)"))
    print_table([{k: r[k] for k in ("layout", "interruptions", "fired", "steps_recomputed", "max_recomputed",
                                    "reference_s", "chaos_s", "lost_s_per_interruption")} | {"ok": not r["problems"]}
                 for r in reports],
                ["layout", "interruptions", "fired", "steps_recomputed", "max_recomputed", "reference_s", "chaos_s",
                 "lost_s_per_interruption", "ok"])
    write_json("chaos", {"seed": seed, "overrides": args.overrides, "reports": reports}, args.out)
    return 0 if all(not r["problems"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
