"""Per layer type at equal width, in fp32 and bf16 side by side (the block cast to bf16, as
DeepSpeed's bf16 mode does): median solver iterations (and the implicit backward's adjoint
iterations), forward+backward time per token, bytes
saved for backward (ratios to ``attn`` in the same precision), and the time of one application of the
fixed-point map f (forward, no grad, at the solve's z*: the per-iteration cost); and the largest
micro-batch whose saved activations fit a memory budget, implicit vs unrolled backward, with
implicit's saved bytes against one differentiable application of f; and seed 000's own measure,
inference: each block in eval mode without grad, its iterations there, forward FLOPs per token
(``LayerSpec.flops``: static + per-iteration x iterations) and latency per token, as ratios to
attn (seed 000: FPSA at 3-6 iterations costs about 1.6x BERT-Base's GFLOPs and 1.3-1.4x its
latency, on an A100 at batch 64).

``mamba`` is the plain-Mamba reference: fpmamba with mixer none, no y feedback, one iteration
(unrolled), i.e. conv -> SiLU -> selective scan -> gate -> norm, run once.

    python bench/layers.py --threads 1                   # d=256 T=256 B=4 on CPU
    python bench/layers.py --d 768 --T 2048 --B 8        # on a GPU (--device: cuda when there is one)

Timing: every block is built and warmed up, then each repeat runs them all in turn; a ratio
(time_x_attn, f_x_mamba) is the median over repeats of the ratio of two times taken moments
apart, so load from other processes that comes and goes mostly cancels.

Bytes are counted by autograd's saved-tensor hooks (parameters and the input excluded), so
they do not depend on the machine; on a GPU, mamba-ssm's scan and flash-attn (where they run)
save what their own kernels save. The micro-batch column extrapolates the bytes measured at
B and 2B (saved bytes are affine in B) to the budget. In bf16 the solver keeps its iterate in
fp32 and raises a tolerance below bf16's floor to the floor (fpscale.solvers.precision). On a GPU
every time is taken between two ``torch.cuda.synchronize()``, and attention inside the blocks runs
on flash-attn in bf16 when it is installed (``FPSCALE_FLASH_ATTN``), as in training. A last table
names the attention and scan kernels each block ran (counted at the call, one training step).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import print_table, write_json

from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.hqsa import bin_assignment, causal_hqsa
from fpscale.layers.looping import LoopedLayer
from fpscale.models import ModelConfig, layer_spec
from fpscale.models.lm import LoopedLM
from fpscale.ops import kernels
from fpscale.ops.attention import causal_attention
from fpscale.profiling import count_saved_bytes
from fpscale.solvers import SolverConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# each type with the solver settings its tiny config ships with
SPECS = {
    "attn": dict(type="attn"),
    "fpsa": dict(type="fpsa", solver={"freeze_converged": True, "backward": "implicit", "backward_max_iter": 20,
                                      "backward_tol": 1e-3}),
    "fpmamba": dict(type="fpmamba", d_state=16, solver={"tol": 0.1, "patience": 3, "decay": 0.5, "backward": "jfb"}),
    "mamba": dict(type="fpmamba", mixer="none", y_feedback=False, d_state=16,
                  solver={"max_iter": 1, "backward": "unroll"}),
    "looped": dict(type="looped", core_blocks=1, solver={"backward": "phantom", "phantom_steps": 2}),
    "epsilon": dict(type="epsilon"),        # HQSA, at most 8 steps, halting prior of mean 3 (seed 003)
}


def block_config(kind: str, d: int, heads: int, T: int) -> ModelConfig:
    return ModelConfig(vocab_size=16, d_model=d, n_heads=heads, max_seq_len=T, layers=[layer_spec(**SPECS[kind])])


def build_block(kind: str, d: int, heads: int, T: int, solver: SolverConfig, dtype=torch.float32,
                device: str | torch.device = "cpu"):
    torch.manual_seed(0)
    return LoopedLM(block_config(kind, d, heads, T), solver).layers[0].to(device=device, dtype=dtype)


def clock(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def iterations(block) -> int:
    """Iterations of the block's last forward (epsilon: steps run; 1 for a block without a solve)."""
    stats = [m.last_stats for m in block.modules() if getattr(m, "last_stats", None) is not None]
    return stats[0].iterations if stats else 1


def run(block, x):
    """Saved bytes, fwd+bwd seconds, iterations (epsilon: steps run), the mean expected depth
    per token (epsilon; else the iterations) and the adjoint's iterations (implicit backward; else
    0) of one training step of ``block``."""
    params = tuple(block.parameters())
    xi = x.clone().requires_grad_()
    t0 = clock(x.device)
    with count_saved_bytes(exclude=(xi, *params)) as counter:
        out = block(xi)
    out.float().pow(2).mean().backward()
    elapsed = clock(x.device) - t0
    stats = [m.last_stats for m in block.modules() if getattr(m, "last_stats", None) is not None]
    its = iterations(block)
    depth = float(stats[0].expected_depth.mean()) if stats and hasattr(stats[0], "expected_depth") else its
    adjoint = (stats[0].backward_iterations or 0) if stats and hasattr(stats[0], "backward_iterations") else 0
    return counter.total, elapsed, its, depth, adjoint


def capture_f(block, x):
    """A callable applying the block's fixed-point map f once (no grad) at the z* its solve found
    from ``x``; None for a block without one (attn, epsilon)."""
    layers = [m for m in block.modules() if isinstance(m, FixedPointLayer)]
    if not layers:
        return None
    layer, captured = layers[0], {}
    solve = layer.fixed_point

    def spy(f, z0, real=None, step_cache=None, **kw):
        z = solve(f, z0, real, step_cache, **kw)
        captured.update(f=f, z=z.detach())
        return z

    layer.fixed_point = spy                 # type: ignore[method-assign]
    try:
        with torch.no_grad():
            block(x)
    finally:
        del layer.fixed_point

    def apply_f():
        with torch.no_grad():
            captured["f"](captured["z"])
    return apply_f


def timed(call, device: torch.device) -> float:
    t0 = clock(device)
    call()
    return clock(device) - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-iter", type=int, default=30)
    ap.add_argument("--tol", type=float, default=2e-2,
                    help="tolerance of fpsa and looped (fpmamba keeps its 0.1); default: one bf16 resolves too")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--hqsa-T", type=int, nargs="+", default=[256, 1024, 4096],
                    help="lengths of the HQSA-against-attention timing")
    ap.add_argument("--compile", action="store_true",
                    help="solver.compile on every fixed-point layer (torch.compile of one application of f)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.B, args.T, args.d).to(device)
    base = SolverConfig(max_iter=args.max_iter, tol=args.tol, stop_quantile=0.0, patience=5, decay=0.7,
                        compile=args.compile)
    # every block is built and warmed up first, then the repeats go round all of them, so each
    # ratio to attn (or mamba) is a median over repeats of times taken moments apart
    keys = [(kind, name) for kind in SPECS for name in args.dtypes]
    blocks = {key: build_block(key[0], args.d, args.heads, args.T, base, DTYPES[key[1]], device).train()
              for key in keys}
    inputs = {name: x.to(DTYPES[name]) for name in args.dtypes}
    ran = {}                       # the attention and scan kernels each block ran, counted at the call
    for (kind, name), block in blocks.items():
        kernels.reset()
        run(block, inputs[name])                                           # warm-up
        ran[kind, name] = kernels.summary()
    results = {key: [] for key in keys}
    for _ in range(args.repeats):
        for (kind, name), block in blocks.items():
            results[kind, name].append(run(block, inputs[name]))
    f_calls = {key: capture_f(block, inputs[key[1]]) for key, block in blocks.items()}
    f_times = {key: [] for key, call in f_calls.items() if call is not None}
    for key in f_times:
        f_calls[key]()                                                     # warm-up
    for _ in range(args.repeats):
        for key in f_times:
            f_times[key].append(timed(f_calls[key], device))
    first = args.dtypes[0]
    rows = []
    for kind in SPECS:
        row = {"layer": kind}
        loops = [m for m in blocks[kind, first].modules() if isinstance(m, LoopedLayer)]
        row["backward"] = loops[0].backward_mode if loops else "-"
        for name in args.dtypes:
            res = results[kind, name]
            row[f"iters_{name}"] = statistics.median(r[2] for r in res)
            row[f"depth_{name}"] = statistics.median(r[3] for r in res)
            row[f"adjoint_{name}"] = statistics.median(r[4] for r in res)
            row[f"saved_MiB_{name}"] = res[0][0] / 2 ** 20
            row[f"us_per_token_{name}"] = 1e6 * statistics.median(r[1] for r in res) / (args.B * args.T)
            f_time = statistics.median(f_times[kind, name]) if (kind, name) in f_times else None
            row[f"f_us_per_token_{name}"] = None if f_time is None else 1e6 * f_time / (args.B * args.T)
            row[f"kernels_{name}"] = ran[kind, name]
        for name in args.dtypes:           # ratios within one precision: attn and mamba in that precision
            row[f"saved_x_attn_{name}"] = row[f"saved_MiB_{name}"] / (results["attn", name][0][0] / 2 ** 20)
            row[f"time_x_attn_{name}"] = statistics.median(
                r[1] / a[1] for r, a in zip(results[kind, name], results["attn", name]))
            row[f"f_x_mamba_{name}"] = statistics.median(
                t / m for t, m in zip(f_times[kind, name], f_times["mamba", name])) if (kind, name) in f_times else None
        rows.append(row)
    print(f"layer types at equal width d={args.d} T={args.T} B={args.B} on {device} (training step, tol {args.tol} "
          f"(fpmamba 0.1), max_iter {args.max_iter}), {' and '.join(args.dtypes)}")
    columns = ["layer", "backward"] + [f"{c}_{n}" for c in ("iters", "depth", "adjoint", "saved_MiB", "us_per_token",
                                                            "f_us_per_token") for n in args.dtypes]
    print_table(rows, columns + [f"{c}_{n}" for c in ("saved_x_attn", "time_x_attn", "f_x_mamba") for n in args.dtypes])
    print_table(rows, ["layer"] + [f"kernels_{n}" for n in args.dtypes])

    # largest micro-batch under a saved-activation budget: implicit vs unroll at a fixed 16 iterations
    budget = args.budget_gib * 2 ** 30
    fit_rows = []
    for kind in ("fpsa", "fpmamba", "looped"):
        for mode in ("implicit", "unroll", "one f"):
            cfg = SolverConfig(max_iter=1 if mode == "one f" else 16, tol=0.0, patience=0,
                               backward="unroll" if mode == "one f" else mode, backward_max_iter=8,
                               mask_unconverged=False)
            block = build_block(kind, args.d, args.heads, args.T, cfg, device=device)
            for m in block.modules():           # the layer's own overrides must not mask the mode
                if hasattr(m, "solver") and hasattr(m, "last_stats"):
                    m.solver = cfg
            b1 = run(block, x[:1])[0]
            b2 = run(block, torch.cat([x[:1], x[:1]]))[0]
            per_sample, fixed = b2 - b1, 2 * b1 - b2
            fit_rows.append({"layer": kind, "backward": mode, "MiB_per_sample": per_sample / 2 ** 20,
                             "max_micro_batch": int((budget - fixed) // per_sample)})
    for kind in ("fpsa", "fpmamba", "looped"):
        imp, unr, one = [r for r in fit_rows if r["layer"] == kind]
        imp["gain_x"] = imp["max_micro_batch"] / max(unr["max_micro_batch"], 1)
        imp["saved_x_one_f"] = imp["MiB_per_sample"] / one["MiB_per_sample"]
    print(f"\nlargest micro-batch whose saved activations fit {args.budget_gib} GiB (16 iterations, T={args.T}); "
          f"'one f': the block with one differentiable application of f")
    print_table(fit_rows, ["layer", "backward", "MiB_per_sample", "max_micro_batch", "gain_x", "saved_x_one_f"])
    inference_rows = inference(args, {kind: blocks[kind, first] for kind in SPECS}, inputs[first])
    hqsa_rows = hqsa_against_attention(args)
    write_json("layers", {"args": vars(args), "layer_rows": rows, "micro_batch_rows": fit_rows,
                          "inference_rows": inference_rows, "hqsa_rows": hqsa_rows}, args.out)


def inference(args, blocks: dict, x: torch.Tensor) -> list[dict]:
    """Seed 000's measure: forward FLOPs and latency per token in eval mode without grad, at the
    iterations each block takes there, as ratios to attn (latency: median over repeats of the
    ratio of times taken moments apart)."""
    for block in blocks.values():
        block.eval()
    times: dict[str, list[float]] = {kind: [] for kind in blocks}
    its: dict[str, list[int]] = {kind: [] for kind in blocks}
    with torch.no_grad():
        for block in blocks.values():
            block(x)                                                       # warm-up
        for _ in range(args.repeats):
            for kind, block in blocks.items():
                times[kind].append(timed(lambda: block(x), x.device))
                its[kind].append(iterations(block))
    rows = []
    for kind in blocks:
        k = statistics.median(its[kind])
        static, per_iter = layer_spec(**SPECS[kind]).flops(block_config(kind, args.d, args.heads, args.T), args.T)
        rows.append({"layer": kind, "iters": k, "MFLOP_per_token": (static + per_iter * k) / 1e6,
                     "us_per_token": 1e6 * statistics.median(times[kind]) / x.shape[0] / x.shape[1]})
    for row in rows:
        row["flops_x_attn"] = row["MFLOP_per_token"] / rows[0]["MFLOP_per_token"]
        row["latency_x_attn"] = statistics.median(t / a for t, a in zip(times[row["layer"]], times["attn"]))
    print(f"\ninference (eval, no grad; {x.dtype}): seed 000 reports FPSA at 3-6 iterations at about 1.6x "
          "BERT-Base's GFLOPs and 1.3-1.4x its latency (A100, batch 64)")
    print_table(rows, ["layer", "iters", "MFLOP_per_token", "flops_x_attn", "us_per_token", "latency_x_attn"])
    return rows


def hqsa_against_attention(args) -> list[dict]:
    """Forward + backward time per token of causal HQSA (16 bins, chunked prefix sums) and of
    causal attention (SDPA, fp32) on the same q, k, v, by length: HQSA is linear in T, attention
    quadratic (seed 003's sub-quadratic claim)."""
    rows = []
    dh, H = args.d // args.heads, args.heads
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    w_bin, protos, log_tau = (t.to(device) for t in (torch.randn(8, dh, generator=g),
                                                      torch.randn(H, 16, 8, generator=g), torch.zeros(H)))
    for T in args.hqsa_T:
        q, k, v = (torch.randn(1, H, T, dh, generator=g).to(device).requires_grad_() for _ in range(3))

        def timed(fn):
            times = []
            for _ in range(args.repeats + 1):              # the first is a warm-up
                t0 = clock(device)
                fn().float().pow(2).mean().backward()
                times.append(clock(device) - t0)
            return 1e6 * statistics.median(times[1:]) / T

        hqsa = timed(lambda: causal_hqsa(q, k, v, bin_assignment(k, w_bin, protos, log_tau))[0])
        attn = timed(lambda: causal_attention(q, k, v))
        rows.append({"T": T, "us_per_token_hqsa": hqsa, "us_per_token_attention": attn,
                     "hqsa_x_attention": hqsa / attn})
    print(f"\ncausal HQSA (16 bins) against causal attention, forward + backward per token (H={H}, d_h={dh}, B=1)")
    print_table(rows, ["T", "us_per_token_hqsa", "us_per_token_attention", "hqsa_x_attention"])
    return rows


if __name__ == "__main__":
    main()
