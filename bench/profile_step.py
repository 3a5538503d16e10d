"""Where a training step's time goes: ``torch.profiler`` over the trainer's own ``train_step`` (a few
steps after warm-up), by category, the top kernels, kernels and host-device synchronisations per step.

    python bench/profile_step.py --config configs/125m_attn.yaml                 # GPU: the recipe as it is
    python bench/profile_step.py --config configs/125m_fpsa.yaml --json p.json --trace p.trace.json
    python bench/profile_step.py --config configs/125m_fpmamba.yaml --small      # CPU: small width, seconds
    python bench/profile_step.py --config configs/125m_attn.yaml --fused-adamw  # CPU with CUDA's fused AdamW
    python bench/profile_step.py --config configs/125m_attn.yaml train.compile=blocks   # any override

Categories (the first rule that matches a kernel, or on CPU a leaf aten op, wins; a name rule also
matches the aten ops it ran under, e.g. ``aten::rms_norm`` around its pow/mean/rsqrt on CPU):
    communication   NCCL / gloo / c10d collectives
    loss_head       anything run inside ``LoopedLM.head_loss`` (its matmul, log-softmax, chunks), forward and
                    backward
    optimizer       anything inside ``Optimizer.step`` or ``zero_grad``, the ``_foreach_*`` kernels (the
                    gradient-norm clip too) and fused Adam/AdamW kernels
    attention       SDPA / flash / memory-efficient attention kernels
    matmul          GEMMs (mm, addmm, bmm, linear, cuBLAS/CUTLASS kernels)
    scan            anything inside FP-Mamba's scan dispatch (fpscale.ops.scan_kernels.scan, fpscale.ops.ssd.ssd:
                    the Triton kernel, mamba-ssm's, or the PyTorch chunked scan's ops), and selective-scan /
                    SSD / causal-conv kernels by name
    norm            layer norm, RMS norm
    solver          the other ops run inside a looped layer's forward (and their backward): the solver's
                    bookkeeping (residuals, flags, damping, freezing, Anderson) and f's own elementwise
                    ops, which the profiler cannot tell apart
    elementwise     everything else (activations, residual adds, RoPE, embeddings, copies, casts)
    idle            GPU: the time inside the profiled steps when no kernel runs (the host launching, a
                    host read waiting); CPU: the host's time outside any aten op (Python, dispatch)
On a GPU the times are the kernels' (CUDA events); on CPU the aten ops' own CPU time, and "kernels" are
the leaf aten ops that compute (views and allocations left out): what would each launch a kernel on a GPU.

Host syncs per step are counted on one extra step by fpscale.profiling.count_syncs (a dispatch mode that
sees ``aten._local_scalar_dense`` and device-to-host copies, and the ``tolist``/``item``/``cpu``/...
methods): the same count on any device. Graph breaks and recompilations are torch._dynamo's counters
over the warm-up and profiled steps (``train.compile``; 0 for an eager run).
Prints a table, writes JSON (``--json``) and a Chrome trace (``--trace``; open it in chrome://tracing or
ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import collections
import re
import time

import torch
from common import print_table, write_json
from gpu import data_source, sync, trainer_for

SMALL = ["model.d_model=64", "model.n_heads=2", "data.seq_len=64", "model.vocab_size=512", "solver.forward.max_iter=8",
         "solver.forward.eval_max_iter=8", "train.precision=fp32"]
CATEGORIES = ("communication", "loss_head", "optimizer", "attention", "matmul", "scan", "norm", "solver",
              "elementwise", "idle")
RULES = [("communication", r"nccl|gloo|c10d|all_reduce|allreduce|all_gather|allgather|reduce_scatter|broadcast"),
         ("optimizer", r"_foreach_|adam|muon"),
         ("attention", r"scaled_dot_product|flash|fmha|efficient_attention|cudnn_attention|attention"),
         ("matmul", r"\bmm\b|::mm|addmm|bmm|matmul|linear|gemm|cutlass|cublas|xmma|nvjet|_scaled_mm|sm\d\d_"),
         ("scan", r"scan|selective|ssd|chunk_state|chunk_scan|conv1d|convolution|causal_conv"),
         ("norm", r"layer_norm|rms_norm|layernorm|rmsnorm")]
NOT_KERNELS = re.compile(r"aten::(view|_unsafe_view|as_strided|reshape|expand|permute|transpose|t|slice|select|"
                         r"unsqueeze|squeeze|empty.*|detach|alias|resolve_.*|lift_fresh|unbind|split|chunk|"
                         r"narrow|contiguous|to|_to_copy|lift|set_|result_type|is_nonzero|size|stride|numel|"
                         r"flatten|unflatten|view_as|expand_as|split_with_sizes|_reshape_alias|item|"
                         r"_local_scalar_dense|zeros|ones|full|scalar_tensor|new_.*|empty_like|zeros_like)$")
SCOPE = "fpscale_profile::"


def scoped(fn, name: str):
    """``fn`` inside a profiler range named ``fpscale_profile::<name>``."""
    def run(*args, **kwargs):
        with torch.profiler.record_function(SCOPE + name):
            return fn(*args, **kwargs)
    run.profile_scoped = True          # type: ignore[attr-defined]
    return run


def add_scopes(trainer) -> None:
    """Label the loss head and the looped layers' forwards (instance attributes shadowing the methods:
    the model is untouched otherwise); the optimizer's step is labelled by torch itself."""
    from fpscale.layers import fpmamba2, fpmamba_map
    model = trainer.model
    model.head_loss = scoped(model.head_loss, "loss_head")
    if not hasattr(fpmamba_map.scan, "profile_scoped"):      # the scan's dispatch points, as the layers import them
        fpmamba_map.scan = scoped(fpmamba_map.scan, "scan")
        fpmamba2.ssd = scoped(fpmamba2.ssd, "scan")
    for layer in model.looped_layers().values():
        layer.register_forward_pre_hook(lambda m, a: setattr(m, "_profile_range", _enter(SCOPE + "solver")))
        layer.register_forward_hook(lambda m, a, o: _exit(m))


def _enter(name: str):
    rf = torch.profiler.record_function(name)
    rf.__enter__()
    return rf


def _exit(module) -> None:
    rf = getattr(module, "_profile_range", None)
    if rf is not None:
        rf.__exit__(None, None, None)
        module._profile_range = None


def category(names: list[str], scope: str | None) -> str:
    """``names``: the kernel's (or op's) name, then the aten ops it ran under, innermost first (on CPU
    ``aten::rms_norm`` runs as pow/mean/rsqrt: the op that called them names the category)."""
    low = [n.lower() for n in names]
    if any(re.search(RULES[0][1], n) for n in low):
        return "communication"
    if scope in ("loss_head", "optimizer", "scan"):
        return scope
    for n in low:
        for cat, pattern in RULES[1:]:
            if re.search(pattern, n):
                return cat
    return "solver" if scope == "solver" else "elementwise"


def aten_chain(e) -> list[str]:
    out, p = [e.name], e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            out.append(p.name)
        p = p.cpu_parent
    return out


def scope_of(evt, by_seq: dict[int, str]) -> str | None:
    """The fpscale or optimizer range an event ran in; a backward op takes its forward op's (through the
    autograd node's sequence number)."""
    e = evt
    while e is not None:
        if e.name.startswith(SCOPE):
            return e.name[len(SCOPE):]
        if e.name.startswith("Optimizer.") or "zero_grad" in e.name:
            return "optimizer"
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr >= 0:
            return by_seq.get(e.sequence_nr)
        e = e.cpu_parent
    return None


def forward_scopes(events) -> dict[int, str]:
    """sequence number -> scope of the forward op that made that autograd node."""
    out: dict[int, str] = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            s = scope_of(e, {})
            if s is not None and e.sequence_nr not in out:
                out[e.sequence_nr] = s
    return out


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse(prof, steps: int, cuda: bool) -> dict:
    events = prof.events()
    by_seq = forward_scopes(events)
    per_cat: dict[str, float] = collections.Counter()
    per_name: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy: list[tuple[float, float]] = []
    window = [e for e in events if e.name == SCOPE + "step"]
    n_kernels = 0
    for e in events:
        if cuda:
            units = [(k.name, k.duration) for k in e.kernels]
        elif is_kernel(e) and not any(is_kernel(c) for c in descendants(e)):
            units = [(e.name, e.cpu_time_total)]
        else:
            units = []
        if not units:
            continue
        scope = scope_of(e, by_seq)
        for name, us in units:
            cat = category([name, *aten_chain(e)] if cuda else aten_chain(e), scope)
            per_cat[cat] += us
            row = per_name[(name, cat)]
            row[0] += us
            row[1] += 1
            n_kernels += 1
        if not cuda:
            busy.append((e.time_range.start, e.time_range.end))
    if cuda:
        kernels = [k for e in events for k in e.kernels]
        busy = [(k.time_range.start, k.time_range.end) for k in kernels] if kernels and hasattr(
            kernels[0], "time_range") else []
        if busy:
            span = max(b for _, b in busy) - min(a for a, _ in busy)
            per_cat["idle"] = max(span - union_us(busy), 0.0)
    else:
        top = [e for e in events if e.name.startswith("aten::") and not _under_aten(e)]
        busy = [(e.time_range.start, e.time_range.end) for e in top]
        span = sum(w.time_range.end - w.time_range.start for w in window)
        per_cat["idle"] = max(span - union_us(busy), 0.0)
    total = sum(per_cat.values()) or 1.0
    top_rows = sorted(({"kernel": n[:70], "category": c, "ms_per_step": v[0] / 1e3 / steps,
                        "calls_per_step": v[1] / steps, "share": v[0] / total}
                       for (n, c), v in per_name.items()), key=lambda r: -r["ms_per_step"])
    return {"shares": {c: per_cat.get(c, 0.0) / total for c in CATEGORIES},
            "ms_per_step": {c: per_cat.get(c, 0.0) / 1e3 / steps for c in CATEGORIES},
            "step_ms": sum(w.time_range.end - w.time_range.start for w in window) / 1e3 / max(len(window), 1),
            "kernels_per_step": n_kernels / steps, "top_kernels": top_rows[:15]}


def is_kernel(e) -> bool:
    """On CPU: an aten op that computes (not a view, an allocation or a read)."""
    return e.name.startswith("aten::") and not NOT_KERNELS.match(e.name)


def descendants(e):
    for c in e.cpu_children:
        yield c
        yield from descendants(c)


def _under_aten(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def profile(config: str, overrides: list[str], warmup: int, steps: int, micro: int, trace: str | None) -> dict:
    from torch._dynamo.utils import counters

    from fpscale.profiling import count_syncs
    data, source = data_source(config, overrides)
    trainer = trainer_for(config, micro, warmup + steps + 1, data + overrides)
    cuda = trainer.device.type == "cuda"
    counters.clear()
    with trainer:
        add_scopes(trainer)
        for _ in range(warmup):
            trainer.train_step()
        sync(trainer.device)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                with torch.profiler.record_function(SCOPE + "step"):
                    trainer.train_step()
                    sync(trainer.device)
        t0 = time.perf_counter()
        with count_syncs() as syncs:
            trainer.train_step()
        sync(trainer.device)
        counted_s = time.perf_counter() - t0
        cfg = trainer.cfg
        from fpscale.parallel.compile import resolve_mode
        compiled = resolve_mode(cfg.train.compile, trainer.model, trainer.device)
    if trace:
        prof.export_chrome_trace(trace)
    out = analyse(prof, steps, cuda)
    return {"config": config, "device": "cuda" if cuda else "cpu", "data": source, "overrides": overrides,
            "micro_batch": micro, "seq_len": cfg.data.seq_len, "d_model": cfg.model.d_model,
            "compile": compiled, "warmup": warmup, "steps": steps,
            "host_syncs_per_step": syncs.total, "host_syncs_by_kind": dict(syncs.by_kind),
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values()), "counted_step_s": counted_s, **out}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    ap.add_argument("--small", action="store_true",
                    help=f"small width for a CPU run in seconds: {' '.join(SMALL)} (the default without a GPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on a GPU, 1 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="profiled steps (default 3 on a GPU, 1 on CPU)")
    ap.add_argument("--micro", type=int, default=0, help="micro-batch (default: the recipe's on a GPU, 1 small)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="torch's fused AdamW on CPU too (CUDA's default, fpscale/train/optim.py): the CPU step then "
                         "counts the host syncs a GPU step makes (CPU's per-tensor AdamW reads each step count)")
    ap.add_argument("--json", help="write the record here (default bench/results/profile_step.json)")
    ap.add_argument("--trace", help="write a Chrome trace of the profiled steps here")
    args = ap.parse_args(argv)
    import os

    import fpscale
    gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpu else "cpu")
    small = args.small or not gpu
    overrides = (SMALL if small else []) + args.overrides
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    steps = args.steps if args.steps is not None else (3 if gpu else 1)
    if args.fused_adamw:
        from fpscale.train import optim
        optim.fused_by_default = lambda params: True
    micro = args.micro or (1 if small else fpscale.load_config(args.config, overrides).train.micro_batch)
    rec = profile(args.config, overrides, warmup, steps, micro, args.trace)
    print(f"{rec['config']} on {rec['device']} ({'CPU op time' if rec['device'] == 'cpu' else 'kernel time'}), "
          f"d {rec['d_model']}, T {rec['seq_len']}, micro-batch {micro}, compile {rec['compile']}: "
          f"{rec['step_ms']:.1f} ms a step, {rec['kernels_per_step']:.0f} kernels a step, "
          f"{rec['host_syncs_per_step']} host syncs a step, {rec['graph_breaks']} graph breaks, "
          f"{rec['recompiles']} recompilations")
    print_table([{"category": c, "share": rec["shares"][c], "ms_per_step": rec["ms_per_step"][c]} for c in CATEGORIES],
                ["category", "share", "ms_per_step"])
    print()
    print_table(rec["top_kernels"], ["kernel", "category", "ms_per_step", "calls_per_step", "share"])
    write_json("profile_step", rec, args.json)
    return rec


if __name__ == "__main__":
    main()
