"""Generate text from a trained model (greedy by default; cached decoding; on the first GPU when
there is one).

    python launch/generate.py --model runs/tiny_mixed/final --prompt "Fellow-Citizens of the Senate"
    # a batch of prompts of different lengths (left-padded: each decodes as it would alone), at depth 8
    python launch/generate.py --model runs/tiny_mixed/final --prompt "The year" --prompt "Our country" --depth 8
    # one cache entry per past token in the looped layers (a plain model's cache size; docs/decoding.md)
    python launch/generate.py --model runs/tiny_mixed/final --cache fixed_point
    # static caches and the forward under torch.compile (one compiled step for every token; docs/decoding.md)
    python launch/generate.py --model runs/tiny_mixed/final --cache fixed_point --compile
"""
from __future__ import annotations

import argparse
import os
import sys

from fpscale.cli import reported
from fpscale.errors import UserError


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="folder with model.safetensors and config.yaml")
    ap.add_argument("--prompt", action="append", help="a prompt; repeat for a batch "
                    "(default: 'Fellow-Citizens of the Senate and House of Representatives:')")
    ap.add_argument("--depth", type=int, default=None,
                    help="evaluation depth: at most this many iterations per looped layer (default: eval_max_iter)")
    ap.add_argument("--tokenizer", help="SentencePiece model (default: next to the config's data.path)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    ap.add_argument("--cache", choices=["exact", "fixed_point"], default=None,
                    help="what the looped layers cache of past tokens (decode.cache; default: the config's, "
                         "docs/decoding.md)")
    ap.add_argument("--no-compact", action="store_true",
                    help="run every row of a batch of prompts to the slowest one's last iteration (decode.compact: "
                         "false; by default a row whose token is done leaves the solve, in both cache modes)")
    ap.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                    help="static caches and the model's forward under torch.compile (BACKEND, default inductor): the "
                         "first tokens compile, later ones reuse the graphs; needs the fixed_point cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="cuda, cuda:1, cpu ... (default: the first GPU if there is one)")
    args = ap.parse_args(argv)
    if args.depth is not None and args.depth < 1:
        ap.error(f"--depth must be >= 1, got {args.depth}")
    prompts = args.prompt or ["Fellow-Citizens of the Senate and House of Representatives:"]

    import sentencepiece as spm
    import torch
    from safetensors.torch import load_file

    import fpscale
    weights = os.path.join(args.model, "model.safetensors")
    if not os.path.exists(weights):
        raise UserError(f"--model {args.model}: no model.safetensors there (launch/convert.py writes one from a "
                        f"checkpoint)")
    cfg = fpscale.load_config(os.path.join(args.model, "config.yaml"))
    model = fpscale.build_model(cfg)
    missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
    if [k for k in missing if k != "lm_head"] or unexpected:
        raise UserError(f"--model {args.model}: the weights do not match the config (missing {missing}, "
                        f"unexpected {unexpected})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval()
    if args.compile:
        if args.no_cache:
            ap.error("--compile decodes with static caches: drop --no-cache")
        if (args.cache or cfg.decode.cache) != "fixed_point":
            ap.error(f"--compile decodes with static caches, which need decode.cache: fixed_point (--cache "
                     f"fixed_point; this one is {args.cache or cfg.decode.cache!r})")
        model.forward = torch.compile(model.forward, backend=args.compile)
    tok_path = args.tokenizer or os.path.join(os.path.dirname(cfg.data.path.rstrip("/")), "tokenizer.model")
    if not os.path.exists(tok_path):
        raise UserError(f"no tokenizer at {tok_path}: pass --tokenizer (the tokenizer.model of the data)")
    sp = spm.SentencePieceProcessor(model_file=tok_path)
    encoded = [sp.encode(p) for p in prompts]
    if not all(encoded):
        ap.error("a --prompt is empty")
    width = max(map(len, encoded))
    batch = torch.tensor([[sp.eos_id()] * (width - len(e)) + e for e in encoded], device=device)
    pad = torch.tensor([width - len(e) for e in encoded], device=device)
    with model.eval_depth(args.depth):
        out = fpscale.generate(model, batch, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               use_cache=not args.no_cache, generator=torch.Generator(device).manual_seed(args.seed),
                               pad=pad if bool(pad.any()) else None, cache=args.cache,
                               compact=False if args.no_compact else None, static=bool(args.compile))
    for row, n_pad in zip(out.tolist(), pad.tolist()):
        print(sp.decode(row[n_pad:]))
    for name, st in model.layer_stats().items():
        how = st.stopped_by if hasattr(st, "stopped_by") else f"expected depth {float(st.expected_depth.mean()):.2f}"
        print(f"# {name}: {st.iterations} iterations on the last token ({how})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
