"""Saved-for-backward bytes and wall time of each backward mode vs the iteration count.

The map is one attention sublayer with input re-injection (d=512, T=512, B=8 by default):
    f(z) = x + Attn(RMSNorm(z))        (8 heads, causal, SDPA)
run with tol = 0 so every one of the ``--iters`` iterations runs, in fp32 and in bf16 (the map's
weights and input in bf16; the solver keeps its iterate in fp32). Ratios are to the bytes saved
by one plain differentiable application of f in the same dtype.

    python bench/solver_memory.py                      # d=512 T=512 B=8, iters 1 4 16 64
    python bench/solver_memory.py --d 128 --T 128 --B 2 --iters 1 4 16   # a quick look
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import print_table, write_json

from fpscale.profiling import count_saved_bytes
from fpscale.solvers import SolverConfig, solve


def attention_map(d: int, heads: int, x: torch.Tensor):
    g = torch.Generator().manual_seed(0)
    wq, wk, wv, wo = (torch.nn.Parameter((torch.randn(d, d, generator=g) / d ** 0.5).to(x.dtype)) for _ in range(4))
    params = [wq, wk, wv, wo]
    B, T, _ = x.shape

    def f(z):
        h = F.rms_norm(z.float(), (d,)).to(x.dtype)       # the iterate arrives in fp32 (the solver's state)
        q, k, v = (F.linear(h, w).view(B, T, heads, d // heads).transpose(1, 2) for w in (wq, wk, wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        return x + 0.5 * F.linear(o, wo)

    return f, params


def measure(f, params, x, cfg: SolverConfig | None):
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    with count_saved_bytes(exclude=(x, *params)) as counter:
        if cfg is None:
            out = f(x)
        else:
            out, stats = solve(f, x.detach().clone(), cfg, training=True)
    t_fwd = time.perf_counter() - t0
    out.float().pow(2).mean().backward()
    t_total = time.perf_counter() - t0
    return counter.total, t_fwd, t_total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--modes", nargs="+", default=["unroll", "implicit", "phantom", "jfb"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.dtypes:
        torch.manual_seed(0)
        x = torch.randn(args.B, args.T, args.d).to(torch.float32 if name == "fp32" else torch.bfloat16)
        f, params = attention_map(args.d, args.heads, x)
        measure(f, params, x, SolverConfig(max_iter=2, tol=0.0, patience=0, backward_max_iter=2, backward_tol=0.0))
        base_bytes, _, base_time = measure(f, params, x, None)
        rows.append({"dtype": name, "mode": "plain f", "iters": 1, "saved_MiB": base_bytes / 2 ** 20, "ratio": 1.0,
                     "fwd_s": None, "fwd+bwd_s": base_time})
        for mode in args.modes:
            for n in args.iters:
                cfg = SolverConfig(max_iter=n, tol=0.0, patience=0, backward=mode, phantom_steps=4,
                                   backward_max_iter=20, backward_tol=0.0, mask_unconverged=False)
                saved, t_fwd, t_total = measure(f, params, x, cfg)
                rows.append({"dtype": name, "mode": mode, "iters": n, "saved_MiB": saved / 2 ** 20,
                             "ratio": saved / base_bytes, "fwd_s": t_fwd, "fwd+bwd_s": t_total})
    print(f"saved-for-backward bytes and time per backward mode: attention sublayer d={args.d} "
          f"T={args.T} B={args.B}, tol=0 (every iteration runs)")
    print_table(rows, ["dtype", "mode", "iters", "saved_MiB", "ratio", "fwd_s", "fwd+bwd_s"])
    write_json("solver_memory", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
