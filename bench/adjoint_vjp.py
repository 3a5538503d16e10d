"""The adjoint's step as ``torch.func.vjp`` inside the compiled chunk (issue 39, an experiment:
``solver.adjoint_step: vjp``: f linearised once per chunk, its pullback applied K times), per
layer type: does the adjoint chunk trace (no fallback to the
eager chunk), and is the training step the eager adjoint's (loss, every gradient, iterations)? float64,
the tiny configs of tests/solvers/test_chunked.py, implicit backward, chunks of 4.

    traced     the adjoint's chunks compiled (none was found untraceable); error: what torch.func raised
    exact      loss bit-equal and the largest gradient difference relative to the gradient's max
    s_step     wall time of the (compiling) step, for scale only

    python bench/adjoint_vjp.py                         # aot_eager: dynamo's trace, eager kernels
    python bench/adjoint_vjp.py --backend inductor      # Inductor's kernels (minutes on a CPU)
"""
from __future__ import annotations

import argparse
import time

import torch
from common import ROOT, print_table, write_json

import fpscale.solvers.chunked as chunked


def step(kind: str, chunk: int, func_vjp: bool):
    import sys
    sys.path.insert(0, str(ROOT))
    from tests.models.helpers import tiny_model, token_batches
    from tests.solvers.test_chunked import SOLVER
    model = tiny_model(kind, dtype=torch.float64, solver={**SOLVER, "backward": "implicit", "chunk": chunk,
                                                          "adjoint_step": "vjp" if func_vjp else "grad"}).train()
    x = token_batches(32, n=1, batch=4, seq=12)[0]
    loss = model(x[:, :-1], targets=x[:, 1:])
    loss.backward()
    (stats,) = model.solver_stats().values()
    return loss.detach(), [p.grad for p in model.parameters()], (stats.iterations, stats.backward_iterations)


def row(kind: str) -> dict:
    chunked._UNTRACEABLE.clear()
    torch._dynamo.reset()
    la, ga, ia = step(kind, 0, False)
    t = time.perf_counter()
    try:
        lb, gb, ib = step(kind, 4, True)
    except RuntimeError as exc:
        return {"layer": kind, "traced": "error", "error": str(exc).splitlines()[0][:110]}
    err = max(((b - a).abs().max() / a.abs().max().clamp_min(1e-300)).item()
              for a, b in zip(ga, gb) if a is not None)
    return {"layer": kind, "traced": not chunked._UNTRACEABLE, "iters_eager": str(ia), "iters_vjp": str(ib),
            "loss_equal": bool(torch.equal(la, lb)), "grad_rel_err": err, "s_step": time.perf_counter() - t}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["fpsa", "fpmamba", "fpmamba2", "looped"])
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    chunked.BACKEND = args.backend
    rows = [row(kind) for kind in args.kinds]
    print(f"the adjoint as torch.func.vjp in the compiled chunk, backend {args.backend}, float64")
    print_table(rows, ["layer", "traced", "iters_eager", "iters_vjp", "loss_equal", "grad_rel_err", "s_step", "error"])
    write_json("adjoint_vjp", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
