"""Bytes one block saves for backward under ``model.checkpoint`` none / mlp / block, per layer type.

Counted by autograd itself (fpscale.profiling.count_saved_bytes, parameters excluded), one
training forward of one block on a [B, T, d] input with dropout on; ``input`` is the block input's
bytes (4 B T d in fp32), what ``block`` keeps of a plain attn block. Looped layers keep their
solve's own backward (implicit by default: the solve saves nothing): ``mlp`` and ``block``
recompute the MLP after it (fpsa, fpmamba with ``mlp: true``); a looped core has nothing outside
its solve. The time column is one forward + backward (CPU or GPU, as --device says).

    python bench/checkpointing.py                          # the 125m recipes' width: d 768, 12 heads, T 1024
    python bench/checkpointing.py --d 64 --heads 4 --T 32 --B 2      # a quick look
"""
from __future__ import annotations

import argparse
import time

import torch
from common import print_table, write_json

import fpscale
from fpscale.profiling import count_saved_bytes

LAYERS = {"attn": "{type: attn}", "fpsa": "{type: fpsa}", "fpmamba+mlp": "{type: fpmamba, mlp: true}",
          "looped": "{type: looped, core_blocks: 1}"}


def block_of(layer: str, mode: str, args) -> torch.nn.Module:
    cfg = fpscale.load_config(None, [
        f"model.layers=[{layer}]", f"model.d_model={args.d}", f"model.n_heads={args.heads}", "model.vocab_size=64",
        f"model.max_seq_len={args.T}", f"data.seq_len={args.T}", "model.dropout=0.1", "model.attn_dropout=0.1",
        f"model.checkpoint={mode}", f"solver.forward.max_iter={args.max_iter}", "solver.forward.stop_quantile=0.0"])
    torch.manual_seed(0)
    return fpscale.build_model(cfg).layers[0].to(args.device).train()


def measure(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, float]:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with count_saved_bytes(tuple(block.parameters())) as counter:
        out = block(x)
    out.float().pow(2).mean().backward()
    sync()
    return counter.total, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--max-iter", type=int, default=4, help="solver iterations of the looped layers")
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/checkpointing.json)")
    args = ap.parse_args(argv)
    x = torch.randn(args.B, args.T, args.d, device=args.device, requires_grad=True)
    input_bytes = x.numel() * x.element_size()
    rows = []
    for name in args.layers:
        saved_none = None
        for mode in ("none", "mlp", "block"):
            block = block_of(LAYERS[name], mode, args)
            measure(block, x)                   # warm-up: lazy imports, allocator, kernels
            saved, seconds = measure(block, x)
            saved_none = saved if saved_none is None else saved_none
            rows.append({"layer": name, "mode": mode, "saved_MiB": saved / 2 ** 20, "saved_bytes": saved,
                         "vs_none": saved / saved_none if saved_none else None,
                         "input_MiB": input_bytes / 2 ** 20, "fwd_bwd_s": seconds})
    print(f"d {args.d}, heads {args.heads}, T {args.T}, B {args.B}, fp32, dropout 0.1, {args.device}")
    print_table(rows, ["layer", "mode", "saved_MiB", "vs_none", "input_MiB", "fwd_bwd_s"])
    write_json("checkpointing", {"args": vars(args), "rows": rows}, args.out)
    return rows


if __name__ == "__main__":
    main()
