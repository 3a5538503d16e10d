"""Cached decoding: milliseconds per new token and the decoding caches' bytes against the prompt length,
per config and cache mode (``decode.cache``: exact, fixed_point; docs/decoding.md).

Each config is built with random weights (its seed) in eval mode, ``model.max_seq_len`` raised to hold
the prompt and the new tokens; a random prompt of T tokens fills the caches (not timed), then
``--new`` greedy tokens are decoded one at a time through the caches; ms/token is the median of those
steps' wall times (the fastest of ``--repeats`` runs: load from other work comes and goes).
``cache_mb`` counts every storage the caches hold (each once) after the last token (T + new tokens),
``per_block_kb`` that divided by the tokens and by the model's attention blocks (an ``attn`` layer, each
block of a ``looped`` core or an ``attractor`` head; an fpsa layer counts as one), a plain model's K/V per
token and block being 2 x d_model x 4 bytes. ``iters/token`` is the mean, over the decoded tokens and
the looped layers, of the solver iterations each new token's solve took; ``rows/step`` the mean, over the
decoded tokens and the looped layers, of the rows f computed in a step's solve summed over its iterations
(``SolverStats.row_iterations``: batch x iterations, less where ``decode.compact`` let the batch's done rows
leave the solve, fpscale.solvers.rows).

``--batch B`` decodes B rows at once: B random prompts, row b left-padded by b T / (2 B) tokens (prompts of
different contents and lengths, so their solves converge at different iterations); ``--compact on off``
measures with the rows' compaction and without it (the same code path as before it existed), alternated
within each row of the table (``--repeats`` of each, interleaved).

    python bench/decode.py --threads 1                           # every tiny config, T 64 and 512, 32 new tokens
    python bench/decode.py --quick                               # T 8, 4 new tokens (tests)
    python bench/decode.py --configs configs/tiny_looped.yaml --modes exact fixed_point --T 64
    python bench/decode.py --device cuda --configs configs/125m_{attn,fpsa,looped,fpmamba}.yaml \
        configs/140m_attractor.yaml --T 512 2048                 # the recipes on a GPU (gpu_checklist --only decode)
    python bench/decode.py --threads 1 --batch 8 --modes fixed_point --compact off on --T 64
    python bench/decode.py --configs runs/tiny_mixed/final --batch 8 --modes fixed_point --compact off on --T 64

``--steps`` measures the decoding step four ways (docs/decoding.md, "Static caches"): ``eager`` (the default:
caches whose attention reads the filled part), ``static`` (static caches: attention over the capacity under a mask,
the position a tensor; eager), ``compiled`` and ``compiled_static`` (the model's forward under ``torch.compile``,
``--compile-mode``: reduce-overhead adds CUDA graphs on a GPU; over dynamic caches, whose length dynamo marks
symbolic, or static ones). A compiled setting decodes once untimed first (its graphs compile there); dynamo's
recompilation limit (8 per code object, shared by every layer's solve) is raised to 64 so that each setting's
graphs stay.

    python bench/decode.py --threads 1 --configs configs/tiny_attn.yaml configs/tiny_looped.yaml --modes fixed_point \
        --steps eager static compiled compiled_static --T 64 512

``--alloc`` adds ``alloc_mb_per_token``: the bytes the allocators hand out per decoded token (torch.profiler's
memory events over an untimed decode of the same tokens): a step that copies its cache shows it here whatever the
machine's load (``exact`` mode concatenated its whole per-iteration cache each step before its EntryBuffer).

    python bench/decode.py --threads 1 --configs configs/tiny_{looped,attractor,fpsa}.yaml --modes exact --T 512 --alloc

A ``--configs`` entry that is a folder is a trained model (its config.yaml and model.safetensors, a run's ``final``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import ROOT, print_table, write_json

import fpscale
from fpscale.layers.step_cache import TokenBuffer

TINY = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("tiny_*.yaml"))
COLUMNS = ["config", "mode", "T", "ms_per_token", "cache_mb", "per_block_kb", "iters_per_token"]
BATCH_COLUMNS = ["config", "mode", "batch", "compact", "T", "ms_per_token", "iters_per_token", "rows_per_step"]
STEPS = ("eager", "static", "compiled", "compiled_static")


def cache_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every storage a (nested) decoding cache holds, each once (a view keeps its whole storage)."""
    seen = set() if seen is None else seen
    if isinstance(obj, TokenBuffer):        # preallocated for model.max_seq_len: its whole capacity counts
        obj = obj.data
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(cache_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(cache_bytes(v, seen) for v in obj)
    return 0


def attention_blocks(cfg) -> int:
    """Attention blocks of the model (what a plain model's K/V cache is counted in)."""
    n = 0
    for spec in cfg.model.expanded_layers():
        if spec.type in ("looped", "attractor"):
            n += spec.core_blocks if spec.type == "looped" else spec.head_blocks
        elif spec.type in ("attn", "fpsa", "fpsa_lh", "epsilon"):
            n += 1
    return n


def measure(path: str, mode: str, T: int, new: int, repeats: int = 1, seed: int = 0, batch: int = 1,
            compact: tuple[str, ...] = ("on",), device: str = "cpu", overrides: tuple[str, ...] = (),
            steps: tuple[str, ...] = ("eager",), compile_mode: str = "default",
            backend: str = "inductor", alloc: bool = False) -> list[dict]:
    """One row per (``compact``, ``steps``) setting; the settings' runs interleaved ``repeats`` times."""
    # caches are preallocated for model.max_seq_len: the prompt and the new tokens exactly
    folder = Path(path) if Path(path).is_dir() else None         # a trained model: config.yaml, model.safetensors
    cfg = fpscale.load_config(str(folder / "config.yaml") if folder else path,
                              [*overrides, f"model.max_seq_len={T + new}", f"data.seq_len={T + new}",
                               "train.global_batch_tokens=0"])        # a recipe's batch in tokens: no training here
    torch.manual_seed(seed)      # an init that draws from the global generator (the same weights in every row)
    model = fpscale.build_model(cfg).eval()
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)     # a step's time includes its kernels
    if folder is not None:
        from safetensors.torch import load_file
        missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
        if [k for k in missing if k != "lm_head"] or unexpected:         # lm_head: tied to the embedding
            raise SystemExit(f"{folder}: weights do not match its config ({missing}, {unexpected})")
    model.to(dev)
    prompt = torch.randint(0, cfg.model.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))
    pad = torch.arange(batch) * T // (2 * batch) if batch > 1 else None
    prompt, pad = prompt.to(dev), pad.to(dev) if pad is not None else None
    layers = model.fixed_point_layers()
    compiling = [step for step in steps if step.startswith("compiled")]
    if compiling:
        torch._dynamo.reset()       # dynamo's recompilation limit counts per code object: the solver's, every config's
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(model.forward, mode=compile_mode, backend=backend) if compiling else None

    def decode(compact_on: bool, step: str, profiler=None):
        static = step.endswith("static")
        forward = compiled if step.startswith("compiled") else model
        place = (lambda n: torch.tensor(n, device=dev)) if static else (lambda n: n)
        times, iters, rows = [], [], []
        with torch.no_grad(), model.decode_cache(mode, compact_on):
            caches = model.new_caches(static=static)
            logits = forward(prompt, caches=caches, pos=place(0), pad=pad)[:, -1]
            tokens = prompt
            if profiler is not None:      # the steps' allocations (the prompt's not counted)
                profiler.start()
            for _ in range(new):
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
                sync()
                t0 = time.perf_counter()
                logits = forward(tokens[:, -1:], caches=caches, pos=place(tokens.shape[1] - 1), pad=pad)[:, -1]
                sync()
                times.append(time.perf_counter() - t0)
                done = [layer.last_stats for layer in layers.values() if layer.last_stats is not None]
                iters += [st.iterations for st in done]
                rows += [st.row_iterations for st in done]
            if profiler is not None:
                profiler.stop()
        return statistics.median(times), iters, rows, cache_bytes(caches)

    def allocated_per_token(setting) -> float:
        """MB the allocator hands out per decoded token (torch.profiler's memory events; an untimed decode)."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        prof = profile(activities=activities, profile_memory=True)
        decode(setting[0] == "on", setting[1], prof)
        events = prof.key_averages()
        total = sum(max(e.self_cpu_memory_usage, 0) + max(getattr(e, "self_device_memory_usage", 0), 0)
                    for e in events)
        return total / new / 2 ** 20

    settings = [(c, step) for c in compact for step in steps]
    for step in compiling:            # their graphs compile in an untimed decode
        decode(compact[0] == "on", step)
    runs: dict = {setting: [] for setting in settings}
    for _ in range(repeats):          # the same tokens each time; the fastest repeat's median (load comes and goes)
        for setting in settings:
            runs[setting].append(decode(setting[0] == "on", setting[1]))
    allocs = {setting: allocated_per_token(setting) for setting in settings} if alloc else {}
    blocks = attention_blocks(cfg)
    out = []
    for (setting, step), got in runs.items():
        _, iters, rows, nbytes = got[-1]
        out.append({"config": str(folder) if folder else Path(path).stem, "device": dev.type, "mode": mode, "T": T,
                    "new": new, "batch": batch, "compact": setting, "step": step,
                    "ms_per_token": 1e3 * min(g[0] for g in got), "ms_runs": [1e3 * g[0] for g in got],
                    "cache_mb": nbytes / 2 ** 20,
                    "per_block_kb": nbytes / batch / (T + new) / blocks / 2 ** 10 if blocks else None,
                    "iters_per_token": statistics.mean(iters) if iters else None,
                    "rows_per_step": statistics.mean(rows) if rows else None, "cache_bytes": nbytes,
                    "alloc_mb_per_token": allocs.get((setting, step))})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=TINY)
    ap.add_argument("--modes", nargs="+", default=["exact", "fixed_point"], choices=["exact", "fixed_point"])
    ap.add_argument("--T", type=int, nargs="+", default=[64, 512], help="prompt lengths")
    ap.add_argument("--new", type=int, default=32, help="new tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=3, help="decoding runs per row: the fastest one's median")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded at once (prompts of different lengths)")
    ap.add_argument("--compact", nargs="+", default=["on"], choices=["on", "off"],
                    help="decode.compact settings to measure, interleaved (both modes compact)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a step's time then waits for its kernels)")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every config (e.g. a recipe at CPU sizes: model.d_model=64)")
    ap.add_argument("--steps", nargs="+", default=["eager"], choices=STEPS,
                    help="decoding steps to measure: eager, static caches, compiled, compiled over static caches")
    ap.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune"],
                    help="torch.compile's mode for the compiled steps (reduce-overhead: CUDA graphs on a GPU)")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend for the compiled steps")
    ap.add_argument("--alloc", action="store_true",
                    help="also MB allocated per decoded token (torch.profiler's memory events, an untimed decode)")
    ap.add_argument("--quick", action="store_true", help="T 8, 4 new tokens (a test's size)")
    ap.add_argument("--out", help="JSON path (default bench/results/decode.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.new, args.repeats = [8], 4, 1
    torch.set_num_threads(args.threads)
    if {"static", "compiled_static"} & set(args.steps) and "exact" in args.modes:
        ap.error("--steps static and compiled_static take --modes fixed_point (a static cache keeps one entry per "
                 "token)")
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    rows: list[dict] = []
    for c in args.configs:          # the JSON rewritten after each config: a run cut short keeps what it measured
        rows += [row for T in args.T for m in args.modes
                 for row in measure(c, m, T, args.new, args.repeats, batch=args.batch, compact=tuple(args.compact),
                                    device=args.device, overrides=tuple(args.override), steps=tuple(args.steps),
                                    compile_mode=args.compile_mode, backend=args.backend, alloc=args.alloc)]
        write_json("decode", {"args": vars(args), "rows": rows, "complete": c == args.configs[-1]}, args.out,
                   quiet=c != args.configs[-1])
    columns = BATCH_COLUMNS if args.batch > 1 or len(args.compact) > 1 else COLUMNS
    if args.steps != ["eager"]:
        columns = [*columns[:2], "step", *columns[2:]]
    if args.alloc:
        columns = [*columns, "alloc_mb_per_token"]
    print_table(rows, columns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
