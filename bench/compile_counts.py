"""What compiling the solver buys, counted on any device (issue 39): per layer type, the eager loop
(``solver.chunk: 0``) against chunks of K iterations compiled as one graph (``solver.chunk: K``).

    graph_breaks   torch._dynamo's graph breaks over an evaluation run at 5 depths (1 to 4 chunks,
                   the last cut by the cap): 0 means the chunk traced whole
    recompiles     recompilations over that run (different iteration counts, different numbers of
                   chunks, a new closure per forward): 0 means one compiled graph served them all
    graphs         graphs compiled
    kernels_iter   Inductor's generated kernels in the chunk's graph / K: the fused kernels an
                   iteration launches beside the extern ones (matmuls, SDPA), against
    aten_iter      the aten ops of one eager iteration (f and the PyTorch bookkeeping; each a
                   launch on a GPU, views included)
    reads_step     host reads of one training step (forward + implicit backward, a live stop):
                   eager loop vs chunked (one per chunk; the adjoint's chunks run eager)
    coll_step      the solver's collectives in that step as TP and ``agree: dp`` would make them
                   (the stop flags' consensus, the norms' state_reduce, the DP sum of the counts),
                   counted on one process through identity stand-ins: eager loop vs chunked (one
                   consensus and one DP sum per chunk; state_reduce stays per iteration; f's own TP
                   collectives are not counted)
    cpu_ratio      CPU time per iteration, compiled chunk / eager loop, measured in this one run
                   (a fixed depth, no grad, median of repeats): below 1 the compiled chunk is faster
And ``train.compile: full`` on a one-layer model: its graph breaks (the solver's host reads) and the
first reason. And ``train.compile: blocks`` (fpscale.parallel.compile) on the plain attn block and on epsilon (one
step of its halting loop compiled): graph breaks, recompilations, generated kernels for the forward and
backward, host reads of the eager step, and CPU time per training step, compiled / eager.

    python bench/compile_counts.py                          # d 64, T 32, B 4, K 4
    python bench/compile_counts.py --d 32 --T 16 --kinds looped    # a quick look (each compile takes
                                                                   # a minute on a busy CPU)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import print_table, write_json
from torch._dynamo.utils import counters
from torch._inductor import metrics

import fpscale
import fpscale.solvers.chunked as chunked
from fpscale.layers.common import Unsharded
from fpscale.models import ModelConfig, layer_spec
from fpscale.parallel.compile import apply_compile
from fpscale.profiling import count_aten_ops, count_host_reads

LIVE = {"tol": 2e-2, "stop_quantile": 0.25, "backward_tol": 1e-3, "backward_max_iter": 16}


def build(kind: str, args, solver: dict | None = None, seed: int = 0):
    cfg = fpscale.load_config(None, [])
    spec = layer_spec(kind)
    if solver is not None:
        spec.solver = dict(solver)
    cfg.model = ModelConfig(vocab_size=64, d_model=args.d, n_heads=args.heads, max_seq_len=args.T + 1, layers=[spec])
    cfg.model.validate()
    torch.manual_seed(seed)
    return fpscale.build_model(cfg)


def tokens(args, extra: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (args.B, args.T + extra), generator=torch.Generator().manual_seed(0))


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Counting(Unsharded):
    """One process standing in for a TP group and a DP group of one: the solver's collectives, counted."""

    def __init__(self):
        self.size, self.calls = 1, 0

    def consensus(self, flags):
        self.calls += 1
        return flags

    def state_reduce(self, t, op):
        self.calls += 1
        return t

    def __call__(self, counts):          # the DP agreement (fpscale.parallel.agree)
        self.calls += 1
        return counts


def reads_per_step(kind: str, args, chunk: int) -> tuple[int, int]:
    """Host reads and the solver's collectives of a training step; the chunks run eager here (the reads
    are one per chunk either way, and a training-mode step would compile the chunk again)."""
    model = build(kind, args, {**LIVE, "max_iter": args.cap, "backward": "implicit", "chunk": chunk,
                               "agree": "dp"}).train()
    counting = Counting()
    for module in model.modules():
        if hasattr(module, "shards"):
            module.shards = counting
        if hasattr(module, "dp_agree"):
            module.dp_agree = counting
    x = tokens(args, 1)
    chunked.COMPILE = False
    try:
        with count_host_reads() as reads:
            model(x[:, :-1], targets=x[:, 1:]).backward()
    finally:
        chunked.COMPILE = True
    return reads.total, counting.calls


def solver_row(kind: str, args) -> dict:
    K = args.chunk
    model = build(kind, args, {"tol": 0.0, "max_iter": args.cap, "chunk": K}).eval()
    x = tokens(args)
    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    depths = [K - 1, K + 1, 2 * K, 3 * K - 1, args.cap]
    with torch.no_grad():
        for depth in depths:
            with model.eval_depth(depth):
                model(x)
    row = {"layer": kind, "K": K, "graph_breaks": sum(counters["graph_break"].values()),
           "recompiles": sum(counters["recompiles"].values()), "graphs": counters["stats"]["unique_graphs"],
           "kernels_iter": metrics.generated_kernel_count / K}
    eager = build(kind, args, {"tol": 0.0, "max_iter": args.cap, "chunk": 0}).eval()
    with torch.no_grad():
        with count_aten_ops() as ops:
            with eager.eval_depth(2 * K):
                eager(x)
        with count_aten_ops() as ops_k:
            with eager.eval_depth(3 * K):
                eager(x)
        row["aten_iter"] = (ops_k.total - ops.total) / K
        t_eager = timed(lambda: eager(x), args.repeats)
        t_chunk = timed(lambda: model(x), args.repeats)
    row["cpu_ratio"] = round(t_chunk / t_eager, 3)
    row["reads_step_eager"], row["coll_step_eager"] = reads_per_step(kind, args, 0)
    row["reads_step_chunk"], row["coll_step_chunk"] = reads_per_step(kind, args, K)
    return row


def blocks_row(kind: str, args) -> dict:
    """``train.compile: blocks`` on a one-layer model of ``kind`` (attn: the whole block; epsilon: one step
    of its halting loop), a training step: graph breaks, graphs, Inductor's kernels, the eager step's
    aten ops and host reads, CPU time compiled / eager."""
    eager, compiled = build(kind, args), build(kind, args)
    apply_compile(compiled, "blocks")
    x = tokens(args, 1)
    torch._dynamo.reset()
    counters.clear()
    metrics.reset()

    def step(model):
        def run():
            model(x[:, :-1], targets=x[:, 1:]).backward()
        return run
    t_compiled = timed(step(compiled), args.repeats)
    row = {"layer": f"{kind} (blocks)", "graph_breaks": sum(counters["graph_break"].values()),
           "recompiles": sum(counters["recompiles"].values()), "graphs": counters["stats"]["unique_graphs"],
           "kernels_fwd_bwd": metrics.generated_kernel_count}
    with count_aten_ops() as ops, count_host_reads() as reads:
        step(eager)()
    row["aten_fwd_bwd"], row["reads_step"] = ops.total, reads.total
    row["cpu_ratio"] = round(t_compiled / timed(step(eager), args.repeats), 3)
    return row


def full_row(kind: str, args) -> dict:
    """``train.compile: full`` on a one-layer model, one training step with a live stop: where it breaks
    (dynamo's graph breaks: traced with aot_eager, no Inductor build)."""
    model = build(kind, args, {**LIVE, "max_iter": args.cap}).train()
    apply_compile(model, "full", backend="aot_eager")
    x = tokens(args, 1)
    torch._dynamo.reset()
    counters.clear()
    model(x[:, :-1], targets=x[:, 1:]).backward()
    (stats,) = model.solver_stats().values()
    reasons = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
    return {"layer": f"{kind} (full)", "iterations": stats.iterations,
            "graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "top_reason": (reasons[0][0].splitlines()[0][:90] if reasons else "")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", nargs="*", default=["fpsa", "fpmamba", "fpmamba2", "looped"])
    ap.add_argument("--blocks", nargs="*", default=["attn", "epsilon"],
                    help="layer types to run under train.compile: blocks")
    ap.add_argument("--full", nargs="*", default=["fpsa"], help="layer types to run under train.compile: full")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    assert chunked.COMPILE
    rows = [solver_row(kind, args) for kind in args.kinds]
    print(f"solver.chunk {args.chunk} compiled vs the eager loop, d={args.d} T={args.T} B={args.B}, cap {args.cap}, "
          f"{torch.get_num_threads()} thread(s)")
    print_table(rows, ["layer", "K", "graph_breaks", "recompiles", "graphs", "kernels_iter", "aten_iter", "cpu_ratio",
                       "reads_step_eager", "reads_step_chunk", "coll_step_eager", "coll_step_chunk"])
    blocks = [blocks_row(kind, args) for kind in args.blocks]
    if blocks:
        print("\ntrain.compile: blocks, one block, a training step (forward + backward)")
        print_table(blocks, ["layer", "graph_breaks", "recompiles", "graphs", "kernels_fwd_bwd", "aten_fwd_bwd",
                             "reads_step", "cpu_ratio"])
    full = [full_row(kind, args) for kind in args.full]
    if full:
        print("\ntrain.compile: full (the whole forward, no fullgraph), one training step with a live stop")
        print_table(full, ["layer", "iterations", "graph_breaks", "graphs", "top_reason"])
    write_json("compile_counts", {"args": vars(args), "solver_rows": rows, "blocks_rows": blocks, "full_rows": full},
               args.out)


if __name__ == "__main__":
    main()
