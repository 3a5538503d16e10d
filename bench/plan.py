"""fpscale-plan's own cost: the wall time of one plan per recipe (every configs/125m_*.yaml and
350m_*.yaml by default), one CPU thread, split into its parts (parameter count, the distinct blocks'
calibration, the unrolled stack's, the loss head's), with the plan's answer for the set-up.

    python bench/plan.py                                  # every 125m/350m recipe, 1 GPU of 80 GiB
    python bench/plan.py --configs configs/125m_fpsa.yaml --gpus 8 --gpu-memory 40

The goal (issue 40): seconds per recipe. Each distinct ``model.layers`` entry is calibrated once
(``repeat`` aside), the loss head measured under FakeTensorMode (nothing computed).
"""
from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

import torch
from common import ROOT, print_table, write_json

import fpscale
from fpscale.train import memory_plan as mp


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def row(path: str, gpus: int, gib: float, engine: str | None) -> dict:
    cfg = fpscale.load_config(path)
    t0 = time.perf_counter()
    plan, total_s = timed(mp.plan, cfg, gpus, gib, True, engine)
    # the parts, timed again on their own (the plan above is the figure that counts)
    _, params_s = timed(mp.parameter_counts, cfg)
    distinct = {repr(s.__class__(**{**s.__dict__, "repeat": 1})) for s in cfg.model.layers}
    _, head_s = timed(mp.calibrate_head, cfg, plan.vocab_per_rank, engine=plan.engine)
    del t0
    return {"config": Path(path).stem, "engine": plan.engine, "layers": len(cfg.model.layers),
            "blocks": sum(s.repeat for s in cfg.model.layers), "distinct": len(distinct),
            "plan_s": total_s, "params_s": params_s, "head_s": head_s,
            "calibrate_s": max(total_s - params_s - head_s, 0.0),
            "largest_micro": plan.largest_micro_batch(), "gib_at_recipe_micro":
                plan.total(cfg.train.micro_batch if isinstance(cfg.train.micro_batch, int) else 1) / mp.GiB}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", help="default: configs/125m_*.yaml and configs/350m_*.yaml")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu-memory", type=float, default=80.0)
    ap.add_argument("--engine", choices=["auto", "deepspeed", "torch"], default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.configs or sorted(glob.glob(str(ROOT / "configs/125m_*.yaml"))
                                     + glob.glob(str(ROOT / "configs/350m_*.yaml")))
    rows = []
    for path in configs:
        rows.append(row(path, args.gpus, args.gpu_memory, None if args.engine in (None, "auto") else args.engine))
        print_table(rows[-1:], list(rows[-1]))
    print(f"\nfpscale-plan per recipe, {args.gpus} GPU(s) of {args.gpu_memory:g} GiB, {args.threads} CPU thread(s) "
          "(plan_s: the whole plan; the parts timed again alone)")
    print_table(rows, list(rows[0]))
    write_json("plan", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
