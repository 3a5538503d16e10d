"""The GPU recipes on the GPU present: throughput, MFU, memory, iterations, the kernels that ran;
flash-attn vs SDPA; the largest micro-batch for implicit vs unrolled backward (the product's promise).

    python bench/gpu.py                          # every configs/125m_*.yaml on cuda:0, bf16
    python bench/gpu.py --configs configs/125m_fpsa.yaml --steps 20
    python bench/gpu.py --quick                  # CPU: tiny configs, seconds (checks the pipeline)
    python bench/gpu.py --micros 8 16 32 auto --no-fit   # MFU against micro-batch (auto: fpscale-plan's largest)
    python bench/gpu.py --compile none auto --micro 0 --no-fit   # eager vs compiled (train.compile), each recipe
    python bench/gpu.py --micro 0 --steps 4 --no-fit --plan --budget-s 200   # the checklist's: each recipe's
                                                 # micro-batch, peak vs fpscale-plan, within 200 s

Per config (one process, one device, micro-batch ``--micro``, no accumulation, ``--steps`` timed
after ``--warmup``): tokens/s, TFLOP/s and MFU nominal (every looped layer counted once) and
executed (the iterations taken), peak memory of the timed steps, mean solver iterations per looped
layer, and the attention and scan kernels that ran (counted at the call, fpscale/ops/kernels.py).
The attention configs run twice, ``FPSCALE_FLASH_ATTN=auto`` (flash-attn where installed) and ``=0``
(SDPA). A config whose token shards are absent (a machine that reaches PyPI and nothing else has no
FineWeb) runs on synthetic tokens of the same geometry, and the row says so. Then, per looped
config, the micro-batch is doubled until the device runs out of memory, with the solver run to
exactly ``--fit-iters`` iterations (tol 0) and the backward implicit or unrolled. On CPU there is
no memory limit to hit: the fit search is skipped and reported as such, and the throughput runs
default to micro-batch 1 and one timed step after no warm-up (the same configs and sequence length:
it checks the pipeline at the real geometry; the figures are a GPU's). The JSON is rewritten
after every run (``complete: false`` until the end), and ``--budget-s`` stops starting runs once
the time is spent (they are listed under ``skipped``): a timeout leaves every finished row.
"""
from __future__ import annotations

import argparse
import glob
import os
import time
from pathlib import Path

from common import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent


def data_source(path: str, extra: list[str]) -> tuple[list[str], str]:
    """(overrides, what the row says): the config's token shards when they are there, else synthetic
    tokens of the same sequence length and vocabulary."""
    import fpscale
    from fpscale.data.shards import TokenShards
    from fpscale.errors import DataError
    cfg = fpscale.load_config(path, extra)
    if cfg.data.source != "shards":
        return [], cfg.data.source
    try:
        TokenShards(cfg.data.path, "train", cfg.data.seq_len)
    except DataError as exc:
        print(f"{Path(path).stem}: synthetic tokens ({exc})")
        return ["data.source=synthetic"], "synthetic"
    return [], cfg.data.path


def recipe_micro(path: str, extra: list[str], value: int | str = 0) -> int:
    """The micro-batch to run: ``value`` when a number (0: the recipe's own), the recipe's ``train.micro_batch``,
    and ``auto`` resolved as the trainer resolves it (fpscale-plan's largest that fits the GPU for one process;
    on CPU, with no memory to plan against, 1)."""
    import torch

    import fpscale
    from fpscale.train.memory_plan import auto_micro_batch
    cfg = fpscale.load_config(path, extra)
    value = value or cfg.train.micro_batch
    if value != "auto":
        return int(value)
    if not torch.cuda.is_available():
        return 1
    return auto_micro_batch(cfg, 1, torch.device("cuda"), "torch")


def trainer_for(path: str, micro: int, steps: int, extra: list[str]):
    import fpscale
    from fpscale.train.trainer import Trainer
    over = [f"train.micro_batch={micro}", "train.global_batch_tokens=0", f"train.global_batch={micro}",
            f"train.steps={steps}", "train.resume=none", "train.out_dir=/tmp/fpscale-bench-gpu",
            "train.log_interval=1000000", "train.eval_interval=1000000", *extra]
    return Trainer(fpscale.load_config(path, over), log=False)


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(path: str, args, flash: str) -> dict:
    import torch

    from fpscale.ops import kernels
    from fpscale.train.metrics import reset_peak_memory, summarize_layers
    from fpscale.train.trainer import as_dicts
    os.environ["FPSCALE_FLASH_ATTN"] = flash
    data, source = data_source(path, args.override)
    trainer = trainer_for(path, args.micro, args.warmup + args.steps, data + args.override)
    device = trainer.device
    for _ in range(args.warmup):
        trainer.train_step()
    sync(device)
    reset_peak_memory(device)
    kernels.reset()
    t0, tokens, window = time.perf_counter(), 0, {}
    for _ in range(args.steps):
        out = trainer.train_step()
        tokens += out["tokens"]
        for name, rows in out["layer_stats"].items():
            window.setdefault(name, []).extend(rows)
    sync(device)
    tokens_per_s = tokens / (time.perf_counter() - t0)
    layers = summarize_layers(as_dicts(window))
    rec = trainer.compute_record(layers, tokens_per_s)
    ran = kernels.used()
    row = {"config": Path(path).stem, "flash": flash, "data": source,
           "attention": ", ".join(ran.get("attention", {})) or "-", "scan": ", ".join(ran.get("scan", {})) or "-",
           "kernel_calls": ran,
           "params_M": trainer.model.num_params() / 1e6, "micro": args.micro, "tokens_per_s": tokens_per_s,
           "tflops_nominal": rec["tflops_nominal"], "tflops_executed": rec["tflops_executed"],
           "mfu_nominal": rec.get("mfu_nominal"), "mfu_executed": rec.get("mfu_executed"),
           "peak_gib": rec["memory_gib"],
           "iters": " ".join(f"{n.split('.')[1]}:{s['iters_mean']:.1f}" for n, s in layers.items()) or "-"}
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def fits(path: str, micro: int, backward: str, args) -> bool:
    """One forward + backward at this micro-batch, the solver at exactly ``fit_iters`` iterations."""
    import torch
    extra = [f"solver.adjoint.backward={backward}", f"solver.forward.max_iter={args.fit_iters}", "solver.forward.tol=0",
             "solver.stop_quantile=0", f"solver.backward_max_iter={args.fit_iters}", "solver.backward_tol=0",
             "model.iteration_cap.dist=none", *args.override]
    trainer = None
    try:
        trainer = trainer_for(path, micro, 1, data_source(path, args.override)[0] + extra)
        trainer.train_step()
        sync(trainer.device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del trainer
        torch.cuda.empty_cache()


def largest_micro_batch(path: str, backward: str, args) -> int:
    best, micro = 0, 1
    while micro <= args.fit_max and fits(path, micro, backward, args):
        best, micro = micro, micro * 2
    return best


def planned_gib(path: str, micro: int, extra: list[str]) -> float | None:
    """fpscale-plan's bytes for the set-up this bench runs (one process, the engine the trainer
    resolves, micro-batch ``micro``), as the trainer's ``memory_gib`` measures them: the caching
    allocator's peak, without the plan's slack and CUDA context (memory_plan.Plan.allocated)."""
    import fpscale
    from fpscale.train import memory_plan
    cfg = fpscale.load_config(path, extra)
    try:
        return memory_plan.plan(cfg, 1, 1e6, unroll=False).allocated(micro) / memory_plan.GiB
    except Exception as exc:          # the plan is a figure beside the run: say why it is missing
        print(f"{Path(path).stem}: no plan ({type(exc).__name__}: {exc})")
        return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", help="default: configs/125m_*.yaml (--quick: tiny_attn, tiny_fpsa)")
    ap.add_argument("--micro", type=int, default=None,
                    help="micro-batch of the throughput runs (default 8 on a GPU, 1 on CPU, quick 2)")
    ap.add_argument("--micros", nargs="*", default=None,
                    help="MFU against micro-batch: run each config at each of these (numbers, or auto: the "
                         "planner's largest that fits), one row each, and print the MFU table")
    ap.add_argument("--compile", nargs="*", default=["auto"],
                    help="train.compile modes to run each config under, one row each (e.g. none auto: eager vs "
                         "compiled; auto compiles nothing on CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3 on a GPU, 0 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on a GPU, 1 on CPU)")
    ap.add_argument("--fit-iters", type=int, default=16)
    ap.add_argument("--fit-max", type=int, default=256, help="stop doubling the micro-batch here")
    ap.add_argument("--quick", action="store_true", help="CPU pipeline check: tiny configs, 2 steps")
    ap.add_argument("--override", nargs="*", default=[], help="config overrides for every run (key=value)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop starting runs once this many seconds have passed (0: no limit); the JSON is "
                         "rewritten after every run, and what was not run is listed as skipped")
    ap.add_argument("--no-fit", action="store_true", help="skip the largest-micro-batch search")
    ap.add_argument("--no-sdpa-twin", action="store_true",
                    help="run the attention configs once (flash auto), not also with FPSCALE_FLASH_ATTN=0")
    ap.add_argument("--plan", action="store_true",
                    help="add fpscale-plan's prediction of the peak (plan_gib) for the same set-up")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    start = time.monotonic()
    import torch
    gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpu else "cpu")
    if args.quick:
        args.configs = args.configs or [str(ROOT / "configs/tiny_attn.yaml"), str(ROOT / "configs/tiny_fpsa.yaml")]
        args.warmup, args.steps, args.micro = 1, 2, args.micro or 2
        args.override = ["data.source=synthetic", "data.seq_len=32", "train.precision=fp32", *args.override]
    configs = args.configs or sorted(glob.glob(str(ROOT / "configs/125m_*.yaml")))
    defaults = (8, 3, 10) if gpu else (1, 0, 1)
    args.micro, args.warmup, args.steps = (v if v is not None else d for v, d in
                                           zip((args.micro, args.warmup, args.steps), defaults))
    import fpscale
    rows, fit_rows, skipped = [], [], []
    columns = ["config", "compile", "flash", "attention", "scan", "data", "params_M", "micro", "tokens_per_s",
               "tflops_executed",
               "mfu_nominal", "mfu_executed", "peak_gib", *(["plan_gib"] if args.plan else []), "iters"]

    def save(done: bool) -> None:          # after every run: a timeout leaves what was measured
        write_json("gpu", {"args": vars(args), "complete": done, "rows": rows, "fit_rows": fit_rows,
                           "skipped": skipped}, args.out, quiet=not done)

    def out_of_time(what: str) -> bool:
        if args.budget_s and time.monotonic() - start > args.budget_s:
            skipped.append(what)
            print(f"skipped {what}: the budget of {args.budget_s:g} s is spent")
            return True
        return False

    for path in configs:
        cfg = fpscale.load_config(path, args.override)
        attention = any(s.type in ("attn", "fpsa", "looped") for s in cfg.model.layers)
        flashes = ("auto", "0") if attention and gpu and not args.no_sdpa_twin else ("auto",)
        for flash in flashes:
            for asked, mode in [(m, c) for m in args.micros or [args.micro] for c in args.compile]:
                micro = recipe_micro(path, args.override, asked)    # 0: the recipe's own (auto: the planner's)
                if out_of_time(f"{Path(path).stem} flash={flash} micro={micro} compile={mode}"):
                    continue
                run = argparse.Namespace(**{**vars(args), "micro": micro,
                                            "override": [*args.override, f"train.compile={mode}"]})
                rows.append({**throughput(path, run, flash), "micro_asked": asked, "compile": mode})
                if args.plan:
                    rows[-1]["plan_gib"] = planned_gib(path, micro,
                                                       data_source(path, args.override)[0] + args.override)
                print_table(rows[-1:], columns)
                save(False)
    print_table(rows, columns)
    if args.micros:
        print("\nMFU executed against micro-batch (tokens/s in brackets)")
        sweep = {}
        for r in rows:
            sweep.setdefault((r["config"], r["compile"], r["flash"]), {})[f"micro {r['micro']}"] = \
                f"{r['mfu_executed']:.1%} ({r['tokens_per_s']:,.0f})" if r.get("mfu_executed") is not None \
                else f"- ({r['tokens_per_s']:,.0f})"
        table = [{"config": c, "compile": m, "flash": f, **cells} for (c, m, f), cells in sweep.items()]
        print_table(table, list(dict.fromkeys(k for row in table for k in row)))
    os.environ["FPSCALE_FLASH_ATTN"] = "auto"
    for path in [] if args.no_fit else configs:
        cfg = fpscale.load_config(path)
        looped = [cfg.solver.with_overrides(s.solver, "").max_iter for s in cfg.model.layers if s.type != "attn"]
        if not any(n > 1 for n in looped):      # attention only, or one-pass layers (125m_mamba)
            continue
        row = {"config": Path(path).stem, "iterations": args.fit_iters}
        if torch.cuda.is_available():
            if out_of_time(f"{Path(path).stem} fit"):
                continue
            for backward in ("implicit", "unroll"):
                row[f"max_micro_{backward}"] = largest_micro_batch(path, backward, args)
            row["gain_x"] = row["max_micro_implicit"] / max(row["max_micro_unroll"], 1)
        else:
            row["max_micro_implicit"] = row["max_micro_unroll"] = "needs a GPU"
        fit_rows.append(row)
        save(False)
    if fit_rows:
        print_table(fit_rows, list(fit_rows[0]))
    save(True)


if __name__ == "__main__":
    main()
