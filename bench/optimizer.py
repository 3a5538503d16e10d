"""Optimizer step time and bytes per parameter, AdamW against MuonAdamW, at the 125m shapes
(configs/125m_attn.yaml: d 768, 12 heads, SwiGLU 2048, vocabulary 50304, untied output layer), at
TP 1 and TP 2 (two gloo processes on CPU; NCCL on GPUs when two are present).

One block is measured and the model's step is 14 x the block + the embedding and output layer (Muon's
Newton-Schulz runs matrix by matrix, AdamW elementwise: both add up over blocks). Under TP every rank
all-gathers each of its matrix slices over the TP group, runs Newton-Schulz on the WHOLE matrix and keeps
its slice (fpscale/train/muon.py): the Newton-Schulz work does not shrink with TP, AdamW's does; the
table shows what that costs. ``state B/param``: the optimizer state the step keeps, measured;
``transient B/param``: the largest matrix's working set during its Newton-Schulz (gathered fp32 slices,
bf16 X, X X^T, its square and the product), computed, per parameter of the block.

    python bench/optimizer.py                   # CPU (GPU when present); prints the table, writes JSON
    python bench/optimizer.py --bf16            # also Newton-Schulz in bf16 on the CPU
    python bench/optimizer.py --repeats 1 --blocks 14 --out /tmp/optimizer.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import print_table, write_json  # noqa: E402

SHAPE = ["model.vocab_size=50304", "model.d_model=768", "model.n_heads=12", "model.max_seq_len=64",
         "model.tie_embeddings=false", "model.layers=[{type: attn}]", "data.source=synthetic", "data.seq_len=64"]


def build(optimizer: str, ns_dtype: str, state=None):
    """(the 125m one-block model, optimizer over its block, optimizer over embedding + head)."""
    import fpscale
    from fpscale.parallel.parallelize import parallelize
    from fpscale.train.optimizers import build_optimizer
    cfg = fpscale.load_config(None, [*SHAPE, f"train.optimizer={optimizer}", f"train.muon.ns_dtype={ns_dtype}",
                                     "train.lr_scale.embed=1.0"])     # role groups for adamw too
    torch.manual_seed(0)
    model = fpscale.build_model(cfg)
    if state is not None:
        model = parallelize(model, state)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", state.local_rank if state else 0) if cuda else torch.device("cpu")
    model = model.to(device)
    block = torch.nn.Module()
    block.layers = model.layers                      # names stay layers.0...: the same roles
    rest = torch.nn.ParameterList([p for n, p in model.named_parameters() if not n.startswith("layers.")])
    tp_group = state.tp_group if state is not None else None
    return model, build_optimizer(block, cfg, tp_group)[0], torch.optim.AdamW(rest.parameters()) if \
        optimizer == "adamw" else build_optimizer(model, cfg, tp_group)[0], device


def time_step(opt, repeats: int, sync) -> float:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()                                       # state created, kernels warm
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def measure(optimizer: str, ns_dtype: str, repeats: int, blocks: int, state=None) -> dict:
    model, block_opt, rest_opt, device = build(optimizer, ns_dtype, state)
    if optimizer != "adamw":          # the rest: only its AdamW groups (the block's Muon is timed apart)
        rest_opt.param_groups = [g for g in rest_opt.param_groups if g["kind"] == "adamw"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_block, t_rest = time_step(block_opt, repeats, sync), time_step(rest_opt, repeats, sync)
    block_params = sum(p.numel() for g in block_opt.param_groups for p in g["params"])
    tp = state.tp_size if state else 1
    biggest = max((p for g in block_opt.param_groups if g.get("kind") == "muon" for p in g["params"]),
                  key=lambda p: p.numel(), default=None)
    transient = 0
    if biggest is not None:           # gathered fp32 whole + bf16 X, X X^T, (X X^T)^2, B X
        whole = biggest.numel() * tp
        small = min(biggest.shape[-2] * (tp if getattr(biggest, "partition_dim", 0) == 0 else 1), biggest.shape[-1])
        transient = whole * 4 + 2 * (2 * whole + 2 * small * small)
    auto = "bf16" if device.type == "cuda" else "fp32"
    name = optimizer if optimizer == "adamw" else f"muon_adamw ({auto if ns_dtype == 'auto' else ns_dtype} NS)"
    return {"optimizer": name, "tp": tp,
            "device": str(device), "block s": t_block, "embed+head s": t_rest, "step s (x%d blocks)" % blocks:
            blocks * t_block + t_rest, "block params": block_params,
            "state B/param": state_bytes(block_opt) / block_params, "transient B/param": transient / block_params}


def worker(rank: int, port: int, repeats: int, blocks: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fpscale.parallel.state import init_parallel
    state = init_parallel(2)
    rows = [measure(o, "auto", repeats, blocks, state) for o in ("adamw", "muon_adamw")]
    if rank == 0:
        queue.put(rows)
    state.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=14, help="blocks of the model (125m_attn: 14)")
    ap.add_argument("--no-tp", action="store_true", help="skip the TP 2 rows")
    ap.add_argument("--bf16", action="store_true", help="also Newton-Schulz in bf16 (on a CPU: 8x slower than fp32)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtypes = ["auto"] + (["bf16"] if args.bf16 else [])
    rows = []
    for o, d in [("adamw", "auto")] + [("muon_adamw", d) for d in dtypes]:
        rows.append(measure(o, d, args.repeats, args.blocks))
        print(rows[-1], flush=True)
    if not args.no_tp:
        import socket

        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, port, args.repeats, args.blocks, queue)) for r in range(2)]
        for p in procs:
            p.start()
        rows += queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    columns = list(rows[0])
    print_table(rows, columns)
    write_json("optimizer", {"rows": rows, "threads": 1}, args.out)


if __name__ == "__main__":
    main()
