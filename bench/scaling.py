"""Parallel layouts: tokens/s and bytes communicated per step beside the theoretical volume.

    python bench/scaling.py   # tiny_mixed: 1, DP2 x ZeRO 0-3, TP2, TP2xDP2; tiny_attn: 1, DP2, TP2, TP2xDP2

Each layout trains under torchrun (gloo on CPU) with DeepSpeed's comms logger on; after warm-up
the logged collectives of the timed steps are turned into ring traffic per rank:
all-reduce of m bytes -> 2(n-1)/n m, reduce-scatter of m -> (n-1)/n m, all-gather of a local
part m -> (n-1) m. DeepSpeed's expected volume per step, with P the bytes of the parameters
(fp32 gradients), is (n-1)/n P times 2 (ZeRO-0: all-reduce), 3 (ZeRO-1: all-reduce, then
all-gather of the updated partitions), 2 (ZeRO-2: reduce-scatter + all-gather), 3 (ZeRO-3:
reduce-scatter + an all-gather in forward and in backward).
Tensor parallelism (attn layers) adds, per micro-batch and rank, 4L + 2 all-reduces of the
B x T x d activations (two per block in forward, two in backward, the embedding and the output
projection) and three [B x T] reductions of the vocab-parallel loss, each 2(n-1)/n of its size;
DeepSpeed's logger does not see them: the benchmark counts the bytes handed to
torch.distributed.all_reduce / all_gather on the TP group while the timed steps run
(``counting_tp_collectives``; DeepSpeed's own reductions on that group, the gradient norm's few
scalars per step, are counted there as well).
A looped layer under TP communicates once per solver iteration (forward and adjoint), so for
tiny_mixed the TP volume depends on the iteration counts: it is measured, with no formula beside it.
On CPU/gloo DeepSpeed
0.19.8 runs ZeRO-2 with a full all-reduce (1.5x the textbook volume), and a small model under ZeRO-3 is
gathered once per step (its parameters stay live between forward and backward).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EXPECTED = {0: 2, 1: 3, 2: 2, 3: 3}


@contextlib.contextmanager
def counting_tp_collectives(tp_group, counter: Counter):
    """Count the bytes handed to ``all_reduce`` and ``all_gather`` on ``tp_group`` (message sizes,
    per op, as DeepSpeed's comms logger counts its own) by wrapping torch.distributed's functions,
    which fpscale's TP mappings look up at each call."""
    import torch.distributed as dist
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is tp_group:
            counter["all_reduce"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    def counted_all_gather(tensor_list, tensor, group=None, async_op=False):
        if group is tp_group:
            counter["all_gather"] += tensor.numel() * tensor.element_size()
        return all_gather(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
    try:
        yield counter
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather


def worker(args) -> None:
    """Runs inside each process of one layout."""
    import torch.distributed as dist

    import fpscale
    from fpscale.train.trainer import Trainer
    overrides = [f"train.steps={args.warmup + args.steps}", "train.log_interval=100000",
                 "train.eval_interval=100000", f"parallel.zero_stage={args.zero}", f"parallel.tp={args.tp}",
                 "train.resume=none"]
    cfg = fpscale.load_config(args.config, overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import deepspeed.comm as dscomm
    trainer = Trainer(cfg, log=False, deepspeed_overrides={
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False}})
    for _ in range(args.warmup):
        trainer.train_step()
    world = trainer.state.world_size
    if world > 1:
        dscomm.comms_logger.comms_dict.clear()
        dist.barrier()
    tp_traffic: Counter = Counter()
    counting = (counting_tp_collectives(trainer.state.tp_group, tp_traffic) if trainer.state.tp_size > 1
                else contextlib.nullcontext())
    with counting:
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(args.steps):
            tokens += trainer.train_step()["tokens"]
        elapsed = time.perf_counter() - t0
    traffic, logged = 0.0, {}
    if world > 1:
        n = trainer.state.dp_size          # DeepSpeed's collectives run over the DP group
        tp = trainer.state.tp_size
        for op, size in tp_traffic.items():
            logged[f"tp_{op}"] = size / args.steps
            traffic += {"all_reduce": 2 * (tp - 1) / tp, "all_gather": tp - 1}[op] * size / args.steps
        for op, sizes in dscomm.comms_logger.comms_dict.items():
            total = sum(size * record[0] for size, record in sizes.items())
            logged[op] = total / args.steps
            factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter_tensor": (n - 1) / n,
                      "all_gather_into_tensor": n - 1}.get(op, 0.0)
            traffic += factor * total / args.steps
    params = trainer.model.num_params()
    if trainer.state.is_main:
        attn_blocks = sum(s.repeat for s in cfg.model.layers if s.type == "attn")
        micro = trainer.batch.micro_batch
        activation = micro * cfg.data.seq_len * cfg.model.d_model * 4
        per_micro = (4 * attn_blocks + 2) * activation + 3 * micro * cfg.data.seq_len * 4
        print(json.dumps({"world": world, "dp": trainer.state.dp_size, "tp": trainer.state.tp_size,
                          "attn_only": all(s.type == "attn" for s in cfg.model.layers),
                          "tp_bytes_per_step": sum(v for k, v in logged.items() if k.startswith("tp_")),
                          "zero": args.zero if world > 1 else None, "tokens_per_s": tokens / elapsed,
                          "param_bytes": 4 * params, "tp_message_bytes": per_micro * trainer.batch.grad_accum,
                          "traffic_bytes_per_step": traffic, "logged_bytes_per_step": logged}), flush=True)
    trainer.close()


def run_layout(config: str, nproc: int, zero: int, steps: int, warmup: int, timeout: float, tp: int = 1) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, 2 // nproc))}
    args = [str(Path(__file__).resolve()), "--worker", "--config", config, "--zero", str(zero),
            "--steps", str(steps), "--warmup", str(warmup), "--tp", str(tp)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(29500 + (os.getpid() + zero + 10 * nproc) % 1000)] + args
           if nproc > 1 else [sys.executable] + args)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"layout dp={nproc} zero={zero} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def worker_args(argv: list[str]) -> argparse.Namespace:
    """The arguments ``run_layout`` hands to each process of one layout (after ``--worker``)."""
    ap = argparse.ArgumentParser(prog="scaling.py --worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--zero", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    return ap.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(worker_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/tiny_mixed.yaml"),
                    help="the config of the DP and TP layouts (every layer type)")
    ap.add_argument("--tp-config", default=str(ROOT / "configs/tiny_attn.yaml"),
                    help="attn-only config for the layouts whose TP volume has a formula")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per layout")
    ap.add_argument("--out", default=None, help="the JSON file (default bench/results/scaling.json)")
    args = ap.parse_args(argv)
    from common import print_table, write_json
    rows = []
    layouts = ([(args.config, 1, 0, 1)] + [(args.config, 2, z, 1) for z in (0, 1, 2, 3)]
               + [(args.config, 2, 1, 2), (args.config, 4, 1, 2)]
               + [(args.tp_config, 1, 0, 1), (args.tp_config, 2, 1, 1), (args.tp_config, 2, 1, 2),
                  (args.tp_config, 4, 1, 2)])
    for config, nproc, zero, tp in layouts:
        r = run_layout(config, nproc, zero, args.steps, args.warmup, args.timeout, tp)
        dp, P = r["dp"], r["param_bytes"]
        expected = EXPECTED[zero] * (dp - 1) / dp * P if dp > 1 else 0.0
        if tp > 1:
            expected = expected + 2 * (tp - 1) / tp * r["tp_message_bytes"] if r["attn_only"] else None
        name = "1 process" if nproc == 1 else " x ".join(
            ([f"TP{tp}"] if tp > 1 else []) + ([f"DP{dp} ZeRO-{zero}"] if dp > 1 else []))
        rows.append({"config": os.path.basename(config), "layout": name, "tokens_per_s": r["tokens_per_s"],
                     "MiB_per_step": r["traffic_bytes_per_step"] / 2 ** 20,
                     "TP_MiB": r["tp_bytes_per_step"] / 2 ** 20,
                     "expected_MiB": None if expected is None else expected / 2 ** 20,
                     "measured/expected": (r["traffic_bytes_per_step"] / expected) if expected else None,
                     "logged": r["logged_bytes_per_step"]})
    print("parallel layouts, fp32 on CPU (gloo); ring traffic per rank per step")
    print_table(rows, ["config", "layout", "tokens_per_s", "MiB_per_step", "TP_MiB", "expected_MiB",
                       "measured/expected"])
    write_json("scaling", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
