"""What ``decode.cache: fixed_point`` changes against ``exact`` on a model: the perplexity of cached decoding
(teacher-forced: after a prompt of ``--prompt`` tokens every later token of a validation window goes through
the cache one at a time, its logits scored), greedy decoding's agreement (``--new`` tokens after each window's
prompt: the fraction of positions with the same token, and of rows equal throughout), the largest logit
difference, and the solver iterations per decoded token (mean over steps and looped layers), at the
configured evaluation depth (``--depths 0``: to convergence) and at capped depths (docs/decoding.md).

    python bench/decode_agreement.py --model runs/tiny_mixed/final --depths 0 2 1     # the quickstart's model
    python bench/decode_agreement.py --model runs/tiny_mixed/final --depths 0 --tol 1e-4   # solved tighter
    python bench/decode_agreement.py --config configs/tiny_mixed.yaml --quick          # random weights (tests)
    python bench/decode_agreement.py --model runs/tiny_mixed/final --only fpsa         # one layer type's share

``--only TYPE``: ``fixed_point`` for that layer type's layers only, the others decode ``exact`` (what the mode
changes per layer type, on one trained model).

``--model`` is a folder with model.safetensors and config.yaml (launch/convert.py, a run's ``final``); its
validation windows are read from the config's ``data.path`` (``--data`` elsewhere); ``--config`` builds
random weights and scores random tokens. Exact decoding equals the full forward (tests/models/test_generate.py):
the ``full_ppl`` column is the full forward's perplexity over the same positions, ``ppl_vs_exact`` the
relative change of the perplexity against exact's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics

import torch
import torch.nn.functional as F
from common import print_table, write_json

import fpscale

COLUMNS = ["depth", "mode", "layers", "ppl", "ppl_vs_exact", "full_ppl", "max_logit_diff", "greedy_agree", "rows_equal",
           "iters_per_token"]


def load(args):
    if args.model:
        from safetensors.torch import load_file
        cfg = fpscale.load_config(os.path.join(args.model, "config.yaml"))
        model = fpscale.build_model(cfg)
        missing, unexpected = model.load_state_dict(load_file(os.path.join(args.model, "model.safetensors")),
                                                    strict=False)
        if [k for k in missing if k != "lm_head"] or unexpected:
            raise SystemExit(f"--model {args.model}: weights do not match its config ({missing}, {unexpected})")
    else:
        cfg = fpscale.load_config(args.config)
        torch.manual_seed(cfg.seed)
        model = fpscale.build_model(cfg)
    return cfg, model.eval()


def windows(args, cfg) -> torch.Tensor:
    length = args.prompt + args.score
    if args.model:
        from fpscale.data.shards import TokenShards
        shards = TokenShards(args.data or cfg.data.path, "val", length)
        return shards.batch(range(min(args.windows, shards.num_samples)))[:, :length]
    return torch.randint(0, cfg.model.vocab_size, (args.windows, length), generator=torch.Generator().manual_seed(0))


def iterations(model) -> list[int]:
    return [st.iterations for st in model.solver_stats().values()]


@contextlib.contextmanager
def cache_mode(model, mode: str, only: str | None = None):
    """``model.decode_cache(mode)``; with ``only``, ``mode`` for that layer type's layers, exact for the rest."""
    with model.decode_cache("exact" if only else mode):
        for name, layer in model.looped_layers().items():
            if only and name.split(".")[-1] == only:
                layer.decode_cache = mode
        yield


@torch.no_grad()
def teacher_forced(model, tokens: torch.Tensor, prompt: int, mode: str, only: str | None = None):
    """Logits [B, L - prompt, V] of positions prompt-1 .. L-2 through the cache, and iterations per step."""
    caches, out, iters = model.new_caches(), [], []
    with cache_mode(model, mode, only):
        out.append(model(tokens[:, :prompt], caches=caches)[:, -1])
        for t in range(prompt, tokens.shape[1] - 1):
            out.append(model(tokens[:, t:t + 1], caches=caches, pos=t)[:, -1])
            iters += iterations(model)
    return torch.stack(out, 1), iters


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))


def greedy(model, prompt: torch.Tensor, new: int, mode: str, only: str | None = None) -> torch.Tensor:
    with cache_mode(model, mode, only):
        return fpscale.generate(model, prompt, new)[:, prompt.shape[1]:]


def measure(model, tokens: torch.Tensor, prompt: int, new: int, depth: int | None,
            only: str | None = None) -> list[dict]:
    targets = tokens[:, prompt:]
    with model.eval_depth(depth), torch.no_grad():
        full = model(tokens[:, :-1])[:, prompt - 1:]
        runs = {mode: teacher_forced(model, tokens, prompt, mode, only) for mode in ("exact", "fixed_point")}
        greedy_tokens = {mode: greedy(model, tokens[:, :prompt], new, mode, only) for mode in ("exact", "fixed_point")}
    rows, exact_nll = [], nll(runs["exact"][0], targets)
    for mode, (logits, iters) in runs.items():
        same = greedy_tokens[mode] == greedy_tokens["exact"]
        rows.append({"depth": depth or "eval", "mode": mode, "layers": only or "all",
                     "ppl": math.exp(nll(logits, targets)),
                     "ppl_vs_exact": math.exp(nll(logits, targets) - exact_nll) - 1,
                     "full_ppl": math.exp(nll(full, targets)),
                     "max_logit_diff": float((logits - runs["exact"][0]).abs().max()),
                     "greedy_agree": float(same.float().mean()), "rows_equal": float(same.all(1).float().mean()),
                     "iters_per_token": statistics.mean(iters) if iters else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="folder with model.safetensors and config.yaml")
    src.add_argument("--config", help="a config: random weights, random tokens")
    ap.add_argument("--data", help="token shards (default: the config's data.path)")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 2], help="0: the configured evaluation cap")
    ap.add_argument("--windows", type=int, default=16, help="validation windows (the batch)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--score", type=int, default=96, help="tokens scored after the prompt")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens after the prompt")
    ap.add_argument("--tol", type=float, help="every fixed-point layer's solver tolerance (default: the config's)")
    ap.add_argument("--only", metavar="TYPE", help="fixed_point for this layer type only (fpsa, looped, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 windows, prompt 8, 8 scored, 6 greedy (tests)")
    ap.add_argument("--out", help="JSON path (default bench/results/decode_agreement.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.windows, args.prompt, args.score, args.new = 4, 8, 8, 6
    torch.set_num_threads(args.threads)
    cfg, model = load(args)
    for layer in model.fixed_point_layers().values():
        layer.solver = dataclasses.replace(layer.solver, tol=args.tol) if args.tol is not None else layer.solver
    types = {name.split(".")[-1] for name in model.looped_layers()}
    if args.only is not None and args.only not in types:
        raise SystemExit(f"--only {args.only}: the model has no such looped layer (it has {', '.join(sorted(types))})")
    tokens = windows(args, cfg)
    rows = [r for depth in args.depths for r in measure(model, tokens, args.prompt, args.new, depth or None, args.only)]
    print_table(rows, COLUMNS)
    write_json("decode_agreement", {"args": vars(args), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
