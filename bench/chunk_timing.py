"""The solver loop three ways on the device present (issue 39), per 125m config with a chunked solve:

    eager      solver.chunk 0: the PyTorch loop (one host read per iteration, bookkeeping as the
               config says: the fused Triton kernels on CUDA)
    compiled   solver.chunk K: chunks of K iterations, each one compiled graph (fullgraph, Inductor)
    graphed    solver.chunk K with solver.cuda_graph: each compiled chunk a captured CUDA graph
               (torch.compile mode reduce-overhead); CUDA only: on another device the column is
               skipped and the row says why

    ms_iter    one solver iteration, no grad (evaluation at a fixed depth, tol 0): the time of a
               forward at 3K iterations minus at K, over 2K, over the looped layers (the plain
               blocks cancel out), median of --repeats
    eager_steps  the steps the compiler refused (their chunks ran eager; the messages: the JSON's
               ``untraceable``), "none" where every chunk ran compiled
    ms_step    one training step, forward + backward (the config's solver, its live stop; the
               adjoint's chunks run eager), no optimizer step, median of --steps after --warmup;
               iters: the forward iterations of the step, mean over the looped layers

    python bench/chunk_timing.py                               # every configs/125m_*.yaml that has a chunked solve
    python bench/chunk_timing.py --configs configs/125m_fpsa.yaml --chunk 8
    python bench/chunk_timing.py --configs configs/125m_fpsa.yaml --backend aot_eager \\
        --override model.d_model=64 model.n_heads=2 data.seq_len=64 --micro 1      # CPU: the pipeline

Precision: bf16 autocast on CUDA (the recipes' train.precision), float32 on CPU. ``--budget-s`` stops
starting configs once spent (listed under ``skipped``); the JSON is rewritten after every config.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import statistics
import time
from pathlib import Path

import torch
from common import print_table, write_json

import fpscale
import fpscale.solvers.chunked as chunked
from fpscale.solvers import SolverConfig

ROOT = Path(__file__).resolve().parent.parent
MODES = ("eager", "compiled", "graphed")
UNTRACEABLE: dict[str, str] = {}      # every step the compiler refused in this run -> its message (the JSON)


def solvers_of(model) -> list:
    """The looped layers whose solve runs the chunked loop (not an iterate-free Mamba, not a halting layer)."""
    return [m for m in model.modules() if isinstance(getattr(m, "solver", None), SolverConfig)
            and hasattr(m, "fixed_point") and not getattr(m, "iterate_free", False)]


def set_mode(model, mode: str, K: int, **extra) -> None:
    for m in solvers_of(model):
        m.solver = dataclasses.replace(m.solver, chunk=0 if mode == "eager" else K, cuda_graph=mode == "graphed",
                                       **extra)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(path: str, mode: str, args, device) -> dict:
    cfg = fpscale.load_config(path, ["data.source=synthetic", *args.override])
    chunked._UNTRACEABLE.clear()          # each row tries the compiler afresh and names its own refusals
    chunked.UNTRACEABLE_WHY.clear()
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).to(device)
    loops = solvers_of(model)
    B, T = args.micro or cfg.train.micro_batch, cfg.data.seq_len
    x = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(device)
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    K = args.chunk
    row = {"config": Path(path).stem, "mode": mode, "K": K if mode != "eager" else 0, "B": B, "T": T,
           "looped_layers": len(loops)}
    # per iteration: evaluation at a fixed depth (tol 0), 3K minus K iterations
    set_mode(model, mode, K, tol=0.0)
    model.eval()

    def forward(depth):
        def run():
            with torch.no_grad(), amp, model.eval_depth(depth):
                model(x[:, :-1])
        return run
    forward(K)(), forward(3 * K)()               # compiles (and captures) outside the timing
    t1, t3 = median_s(forward(K), args.repeats, device), median_s(forward(3 * K), args.repeats, device)
    row["ms_iter"] = 1e3 * (t3 - t1) / (2 * K) / max(len(loops), 1)
    # per training step: the config's own solver (live stop), forward + backward
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).to(device).train()
    set_mode(model, mode, K)

    def step():
        with amp:
            loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
    for _ in range(args.warmup):
        step()
    row["ms_step"] = 1e3 * median_s(step, args.steps, device)
    iters = [s.iterations for s in model.solver_stats().values()]
    row["iters"] = sum(iters) / max(len(iters), 1)
    # a step the compiler refused runs its chunks eager: the row says which (the JSON has the messages)
    row["eager_steps"] = ("-" if mode == "eager" else
                          ", ".join(sorted({n.split(".<locals>")[-1].lstrip(".") for n in chunked.UNTRACEABLE_WHY}))
                          or "none")
    UNTRACEABLE.update(chunked.UNTRACEABLE_WHY)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", help="default: configs/125m_*.yaml with a chunked solve")
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--micro", type=int, default=0, help="micro-batch (0: the config's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor", help="the compiled chunk's backend (aot_eager: no C++ build)")
    ap.add_argument("--override", nargs="*", default=[], help="config overrides for every run (key=value)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting configs after this long (0: no limit)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunked.BACKEND = args.backend
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = args.configs or sorted(p for p in glob.glob(str(ROOT / "configs" / "125m_*.yaml"))
                                   if not p.endswith("125m_attn.yaml"))
    started, rows, skipped = time.monotonic(), [], []

    def save(done: bool) -> None:
        write_json("chunk_timing", {"args": vars(args), "device": str(device), "rows": rows, "skipped": skipped,
                                    "untraceable": UNTRACEABLE, "complete": done},
                   args.out, quiet=not done)
    for path in paths:
        name = Path(path).stem
        if args.budget_s and time.monotonic() - started > args.budget_s:
            skipped.append(f"{name}: the budget of {args.budget_s:g} s is spent")
            continue
        if not solvers_of(fpscale.build_model(fpscale.load_config(path, ["data.source=synthetic", *args.override]))):
            skipped.append(f"{name}: no chunked solve (iterate-free or halting layers only)")
            continue
        for mode in MODES:
            if mode == "graphed" and device.type != "cuda":
                skipped.append(f"{name} graphed: solver.cuda_graph captures CUDA graphs, no CUDA device here "
                               f"({device})")
                continue
            rows.append(measure(path, mode, args, device))
            save(False)
    eager = {r["config"]: r for r in rows if r["mode"] == "eager"}
    for r in rows:
        base = eager.get(r["config"])
        r["iter_vs_eager"] = round(r["ms_iter"] / base["ms_iter"], 3) if base and base["ms_iter"] > 0 else None
        r["step_vs_eager"] = round(r["ms_step"] / base["ms_step"], 3) if base else None
    print(f"solver loop eager / compiled / graphed on {device}, chunk {args.chunk}, backend {args.backend}")
    print_table(rows, ["config", "mode", "K", "B", "T", "looped_layers", "ms_iter", "iter_vs_eager", "ms_step",
                       "step_vs_eager", "iters", "eager_steps"])
    for s in skipped:
        print(f"skipped {s}")
    save(True)


if __name__ == "__main__":
    main()
