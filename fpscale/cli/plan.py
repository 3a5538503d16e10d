"""What one GPU holds in a training step of a config, and the largest micro-batch that fits.

    fpscale-plan --config configs/125m_fpmamba.yaml --gpus 8 --gpu-memory 40
    python launch/plan.py --config configs/350m_fpsa.yaml --gpus 16 --gpu-memory 80 --json plan.json \
        parallel.zero_stage=2

Per GPU, for the engine the job runs (``--engine``; DeepSpeed for several GPUs, torch's AdamW for
one, as the trainer resolves ``parallel.engine``): weights, gradients and optimizer states for
``parallel.zero_stage`` and ``parallel.tp``
(data parallel = gpus / tp), DeepSpeed's communication buffers, the bytes each layer type and the
loss head save for backward, and the head's transient; then the largest micro-batch whose total
(x the allocator slack, + the CUDA context; the row ``allocated`` is the sum without them, what
the trainer's ``memory_gib`` reports) fits --gpu-memory, for the configured backward and,
where the config has fixed-point layers, the unrolled one at its cap. The model of memory, what
it counts and what it leaves out: fpscale/train/memory_plan.py. Nothing runs on a GPU: the
activations are measured on the CPU at small sizes, each distinct block once, the loss head without
computing (seconds: bench/plan.py times every recipe). Exit code 2 for a bad
argument or config.
"""
from __future__ import annotations

import argparse
import json
import sys

from fpscale.cli import reported
from fpscale.errors import UserError


def table(p, micro_batches: list[int]) -> str:
    from fpscale.train.memory_plan import CONTEXT_GIB, SLACK, GiB
    s = p.states
    engine = "torch's AdamW, one process" if p.engine == "torch" else f"DeepSpeed ZeRO-{p.zero_stage}"
    lines = [f"per GPU ({engine}): {p.gpus} GPUs = tp {p.tp} x data-parallel {p.dp}, {p.gpu_memory_gib:g} GiB, "
             f"sequence {p.seq_len}; {s.params_per_rank / 1e6:.1f}M parameters per rank, gradients in {s.grad_dtype}",
             f"  {'weights':<28}{s.weights / GiB:8.2f} GiB", f"  {'gradients':<28}{s.gradients / GiB:8.2f} GiB",
             f"  {'optimizer states':<28}{s.optimizer / GiB:8.2f} GiB",
             f"  {'communication buffers':<28}{s.buffers / GiB:8.2f} GiB"]
    for unroll in ([False, True] if p.unroll_layers else [False]):
        fits = p.layers if not unroll else p.unroll_layers
        modes = ", ".join(sorted({f"{f.kind} {f.mode}" + (f" x{f.iterations}" if f.iterations else "")
                                  for f in fits if f.mode != "-"}))
        lines.append(f"activations ({'unrolled backward at the cap' if unroll else 'configured backward'}"
                     f"{': ' + modes if modes else ''}), GiB at micro-batch:")
        parts = list(p.activations(micro_batches[0], unroll))
        lines.append(f"  {'micro-batch':<28}" + "".join(f"{B:>9}" for B in micro_batches))
        for part in parts:
            lines.append(f"  {part:<28}" + "".join(f"{p.activations(B, unroll)[part] / GiB:9.2f}"
                                                  for B in micro_batches))
        lines.append(f"  {'allocated (memory_gib)':<28}" + "".join(f"{p.allocated(B, unroll) / GiB:9.2f}"
                                                                  for B in micro_batches))
        lines.append(f"  {'total x%.2f + %g GiB' % (SLACK, CONTEXT_GIB):<28}"
                     + "".join(f"{p.total(B, unroll) / GiB:9.2f}" for B in micro_batches))
        lines.append(f"  {'fits':<28}" + "".join(f"{'yes' if p.fits(B, unroll) else 'no':>9}" for B in micro_batches))
        lines.append(f"  largest micro-batch that fits: {p.largest_micro_batch(unroll)}")
    return "\n".join(lines)


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fpscale-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of the job (tp x data parallel)")
    ap.add_argument("--gpu-memory", type=float, required=True, help="memory of one GPU, GiB")
    ap.add_argument("--micro-batches", default="1,2,4,8,16,32", help="micro-batches to tabulate (comma-separated)")
    ap.add_argument("--engine", choices=["auto", "deepspeed", "torch"], default=None,
                    help="who trains (default: the config's parallel.engine; auto = DeepSpeed for several GPUs, "
                         "torch's AdamW for one; a one-GPU job under the deepspeed launcher: deepspeed)")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="write the figures as JSON (a file, or - for stdout)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    args = ap.parse_args(argv)
    try:
        micro_batches = [int(b) for b in args.micro_batches.split(",")]
    except ValueError:
        raise UserError(f"--micro-batches must be comma-separated integers, got {args.micro_batches!r}") from None
    if not micro_batches or min(micro_batches) < 1:
        raise UserError(f"--micro-batches must be positive, got {args.micro_batches!r}")
    import fpscale
    from fpscale.train import memory_plan
    cfg = fpscale.load_config(args.config, args.overrides)
    if args.engine:
        cfg.parallel.engine = args.engine
    p = memory_plan.plan(cfg, args.gpus, args.gpu_memory)
    if args.json == "-":
        print(json.dumps(p.to_dict(micro_batches), indent=1))
        return 0
    print(table(p, micro_batches))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(p.to_dict(micro_batches), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
