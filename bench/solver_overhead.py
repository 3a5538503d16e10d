"""What the solver costs the host beyond f: host reads (synchronisations) and aten ops per iteration.

For each looped layer type (a one-layer model) and backward mode, three read schedules:
    eager       tol 2e-2 (live stop), check_every 1: the stop decision is read every iteration
    tol0        tol 0 (a fixed depth, Huginn/Parcae style): no stop rule can fire, one read per solve
    every4      tol 2e-2, check_every 4: the decision is read every 4th iteration (and at the cap)
reported as host reads per training step (forward + backward, counted by patching the
tensor-to-host methods: fpscale.profiling) and per solve, with the iterations run.
Then the aten ops of one iteration (a TorchDispatchMode, counted between caps 4 and 8 of a no-grad
forward solve, so set-up is excluded): those inside f and the solver's bookkeeping around it, for
each ``solver.bookkeeping``: torch (the PyTorch loop) and fused (fpscale.solvers.fused: a Triton
launch counts as one op), and the bytes those ops read and write. On a machine without CUDA the
fused kernels run under Triton's interpreter (this script sets TRITON_INTERPRET=1 before fpscale
is imported): the counts are the same as on a GPU, which is what the table is for. Last, the wall
time of one forward iteration per bookkeeping (caps 8 and 4 differenced). Model, tokens and solver
live on one device: ``cuda`` wherever CUDA is available (``DEVICE``), else the CPU.

    python bench/solver_overhead.py                       # d 128, T 128, B 8
    python bench/solver_overhead.py --d 32 --T 16 --B 2   # a quick look
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import time

import torch
from common import print_table, write_json

if not torch.cuda.is_available():       # the fused kernels on CPU: Triton decides at their definition
    os.environ.setdefault("TRITON_INTERPRET", "1")
# model, inputs and solver on one device: the GPU where there is one (the fused bookkeeping refuses
# CPU tensors there, with no interpreter), else the CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

import fpscale  # noqa: E402
from fpscale.models import ModelConfig, layer_spec  # noqa: E402
from fpscale.profiling import count_aten_ops, count_host_reads  # noqa: E402
from fpscale.solvers import fused  # noqa: E402

chunked_module = importlib.import_module("fpscale.solvers.chunked")
solve_module = importlib.import_module("fpscale.solvers.solve")    # the package exports solve()

LIVE = {"tol": 2e-2, "stop_quantile": 0.25, "backward_tol": 1e-3}
BOOKKEEPING = ["torch", "fused"] if fused.AVAILABLE else ["torch"]     # fused needs triton
SCHEDULES = {"eager": LIVE, "tol0": {"tol": 0.0, "backward_tol": 0.0}, "every4": {**LIVE, "check_every": 4}}


def build(kind: str, d: int, heads: int, T: int, solver: dict, seed: int = 0):
    cfg = fpscale.load_config(None, [])
    spec = layer_spec(kind)
    spec.solver = dict(solver)
    cfg.model = ModelConfig(vocab_size=64, d_model=d, n_heads=heads, max_seq_len=T + 1, layers=[spec])
    cfg.model.validate()
    torch.manual_seed(seed)
    model = fpscale.build_model(cfg).to(DEVICE)
    model.train()
    return model


def tokens(B: int, T: int) -> torch.Tensor:
    """[B, T] token ids on DEVICE, the same on every device."""
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def reads_row(kind: str, mode: str, schedule: str, args) -> dict:
    solver = {**SCHEDULES[schedule], "max_iter": args.max_iter, "backward_max_iter": args.max_iter,
              "backward": mode}
    model = build(kind, args.d, args.heads, args.T, solver)
    x = tokens(args.B, args.T + 1)
    with count_host_reads() as reads:
        loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
    (stats,) = model.solver_stats().values()
    solves = 1 + (stats.backward_iterations is not None)
    return {"layer": kind, "backward": mode, "schedule": schedule, "fwd_iters": stats.iterations,
            "bwd_iters": stats.backward_iterations, "reads_per_step": reads.total,
            "reads_per_solve": reads.total / solves,
            "reads_per_iter": reads.total / (stats.iterations + (stats.backward_iterations or 0))}


@contextlib.contextmanager
def counting_iterate(ops):
    """Count the aten ops inside f separately from the rest of each ``iterate`` call."""
    inner = {"f": 0, "iters": 0}
    real = solve_module.run_loop

    def counted(step, *a, **kw):
        def f(z):
            before, bytes_before = ops.total, ops.bytes
            out = step(z)
            inner["f"] += ops.total - before
            inner["f_bytes"] = inner.get("f_bytes", 0) + ops.bytes - bytes_before
            return out
        before, bytes_before = ops.total, ops.bytes
        result = real(f, *a, **kw)
        inner["all"] = inner.get("all", 0) + ops.total - before
        inner["all_bytes"] = inner.get("all_bytes", 0) + ops.bytes - bytes_before
        inner["iters"] += result.iterations
        return result

    solve_module.run_loop = counted
    try:
        yield inner
    finally:
        solve_module.run_loop = real


def ops_in_solve(kind: str, schedule: str, cap: int, args, bookkeeping: str) -> dict:
    solver = {**SCHEDULES[schedule], "max_iter": cap, "tol": 0.0, "bookkeeping": bookkeeping}  # the whole cap
    model = build(kind, args.d, args.heads, args.T, solver)
    x = tokens(args.B, args.T)
    every = {"eager": 1, "tol0": None, "every4": 4}[schedule]
    real_schedule = chunked_module.read_schedule
    chunked_module.read_schedule = lambda cfg, n: every              # the schedule, whatever tol
    try:
        with torch.no_grad(), count_aten_ops() as ops, counting_iterate(ops) as inner:
            model(x)
    finally:
        chunked_module.read_schedule = real_schedule
    assert inner["iters"] == cap, inner
    return inner


def ops_row(kind: str, schedule: str, args) -> dict:
    row: dict = {"layer": kind, "schedule": schedule}
    for bookkeeping in BOOKKEEPING:
        a, b = (ops_in_solve(kind, schedule, cap, args, bookkeeping) for cap in (4, 8))
        f_ops = (b["f"] - a["f"]) / 4
        all_ops = (b["all"] - a["all"]) / 4
        row["f_ops_per_iter"] = f_ops
        row[f"solver_ops_{bookkeeping}"] = all_ops - f_ops
        moved = (b["all_bytes"] - a["all_bytes"] - b["f_bytes"] + a["f_bytes"]) / 4
        row[f"solver_MiB_{bookkeeping}"] = round(moved / 2 ** 20, 3)
    return row


def ms_per_iteration(kind: str, args, bookkeeping: str, reps: int = 3) -> float:
    """Wall time of one forward iteration (no grad, tol 0: the solve runs to its cap): the best of
    ``reps`` forwards at caps 4 and 8, differenced, so that everything outside the loop cancels."""
    best = {}
    for cap in (4, 8):
        model = build(kind, args.d, args.heads, args.T, {"max_iter": cap, "tol": 0.0, "stop_quantile": 0.0,
                                                         "bookkeeping": bookkeeping})
        x = tokens(args.B, args.T)
        with torch.no_grad():
            model(x)                          # warm-up: kernels compiled, caches filled
            best[cap] = math.inf
            for _ in range(reps):
                synchronize()
                t0 = time.perf_counter()
                model(x)
                synchronize()
                best[cap] = min(best[cap], time.perf_counter() - t0)
    return (best[8] - best[4]) / 4 * 1e3


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--max-iter", type=int, default=16)
    ap.add_argument("--kinds", nargs="+", default=["fpsa", "fpmamba", "looped"])
    ap.add_argument("--modes", nargs="+", default=["implicit", "jfb", "unroll"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    read_rows = [reads_row(kind, mode, schedule, args) for kind in args.kinds for mode in args.modes
                 for schedule in SCHEDULES]
    op_rows = [ops_row(kind, schedule, args) for kind in args.kinds for schedule in SCHEDULES]
    time_rows = [{"layer": kind, "device": DEVICE.type,
                  **{f"ms_per_iter_{b}": ms_per_iteration(kind, args, b) for b in BOOKKEEPING}}
                 for kind in args.kinds]
    print(f"host reads per training step (forward + backward), d={args.d} T={args.T} B={args.B}, "
          f"cap {args.max_iter} (forward and adjoint)")
    print_table(read_rows, ["layer", "backward", "schedule", "fwd_iters", "bwd_iters", "reads_per_step",
                            "reads_per_solve", "reads_per_iter"])
    print("\naten ops per forward iteration (no grad): inside f vs the solver's bookkeeping (incl. the read), "
          "by solver.bookkeeping (a Triton launch counts as one)")
    print_table(op_rows, ["layer", "schedule", "f_ops_per_iter", *(f"solver_ops_{b}" for b in BOOKKEEPING),
                          *(f"solver_MiB_{b}" for b in BOOKKEEPING)])
    print("(solver_MiB: the bytes the bookkeeping's ops read and write per iteration, views aside: the "
          "memory traffic beside f's)")
    print(f"\nwall time per forward iteration on {DEVICE} (no grad, best of 3, caps 8 - 4)"
          + (" (the fused kernels under Triton's interpreter: their CPU time means nothing)"
             if DEVICE.type == "cpu" else ""))
    print_table(time_rows, ["layer", "device", *(f"ms_per_iter_{b}" for b in BOOKKEEPING)])
    write_json("solver_overhead", {"args": vars(args), "device": str(DEVICE), "read_rows": read_rows,
                                   "op_rows": op_rows, "time_rows": time_rows}, args.out)
    assert all(math.isfinite(r["reads_per_step"]) for r in read_rows)


if __name__ == "__main__":
    main()
