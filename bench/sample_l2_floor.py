"""What a bf16 map resolves for ``solver.norm: sample_l2`` (Attractor's whole-sample residual).

fpscale.solvers.precision's floor (2 eps: bf16 0.0156) was measured for the per-token inf-norm residual.
The whole-sample L2 residual averages the rounding over every element of a sample, and Attractor's map
y -> head(y + c) - y rounds only its gated branches (the residual sums stay float32), so it can reach
far lower. This runs the ``attractor`` layer of a small model (tol 0: the cap, the residual of every
iteration recorded) in fp32, with bf16 weights and under bf16 autocast, and reports per precision the
lowest residual the slowest sample of the batch reached (the p = 0 rule waits for it) and the median
over the last 10 iterations: the floor a tolerance must sit above.

``--norm l2`` measures the per-token L2 residual of the causal solve (``decisions: token``, fpscale's
Anderson: configs/*_attractor.yaml), the slowest token of the batch: the largest of B x T numbers,
where sample_l2 takes the largest of B.

    python bench/sample_l2_floor.py                  # d 128, T 128, B 4, 60 iterations, 3 seeds
    python bench/sample_l2_floor.py --norm l2        # the per-token residual of the causal solve
"""
from __future__ import annotations

import argparse
import importlib

import torch
from common import print_table, write_json

import fpscale

iterate_module = importlib.import_module("fpscale.solvers.iterate")


def run(precision: str, d: int, T: int, B: int, iters: int, seed: int, gate: float, norm: str) -> dict:
    solve = ([f"solver.norm={norm}", "solver.decisions=token", "solver.anderson_variant=fpscale"] if norm == "l2"
             else ["solver.norm=sample_l2", "solver.decisions=sample", "solver.anderson_variant=attractor"])
    cfg = fpscale.load_config("configs/tiny_attractor.yaml", [*solve,
        f"model.d_model={d}", f"model.max_seq_len={T}", f"data.seq_len={T}", f"model.layers.1.gate_init={gate}",
        "solver.forward.tol=0.0",
        f"solver.max_iter={iters}", f"solver.eval_max_iter={iters}", f"model.init_std={(2 / (5 * d)) ** 0.5}"])
    torch.manual_seed(seed)
    model = fpscale.build_model(cfg).eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    seen: list[float] = []
    name = "sample_residual" if norm == "sample_l2" else "token_residual"
    original = getattr(iterate_module, name)

    def recording(*args, **kwargs):
        res = original(*args, **kwargs)
        seen.append(float(res.max()))
        return res

    setattr(iterate_module, name, recording)
    try:
        tokens = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            model(tokens)
    finally:
        setattr(iterate_module, name, original)
    tail = sorted(seen[-10:])
    return {"norm": norm, "precision": precision, "seed": seed, "min": min(seen), "tail_median": tail[len(tail) // 2],
            "last": seen[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--gate", type=float, default=0.1, help="gate_init: small enough that fp32 converges")
    ap.add_argument("--norm", choices=["sample_l2", "l2"], default="sample_l2")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [run(p, args.d, args.T, args.B, args.iters, s, args.gate, args.norm)
            for p in ("fp32", "bf16", "autocast") for s in range(args.seeds)]
    print_table(rows, ["norm", "precision", "seed", "min", "tail_median", "last"])
    write_json("sample_l2_floor", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
