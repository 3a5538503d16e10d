"""Prepare token shards from FineWeb (streamed from the hub) or local files in its schema.

    python data/prepare_fineweb.py --name sample-10BT --out cache/fineweb --vocab-size 50304
    python data/prepare_fineweb.py --files 'cache/corpus/raw/*.parquet' --out cache/corpus --vocab-size 8000
    python data/prepare_fineweb.py --files 'raw/*.parquet' --out cache/gpt2 --tokenizer gpt2/tokenizer.json

Re-running the same command continues an interrupted preparation; a folder prepared with other
settings is refused (exit 2, naming what differs) unless --overwrite. See fpscale/data/prepare.py.
"""
import argparse
import os
import sys
import time

from fpscale.cli import reported
from fpscale.data.prepare import prepare


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--name", help="FineWeb config on the hub, e.g. sample-10BT")
    src.add_argument("--files", nargs="+", help="local .parquet / .jsonl files (globs) in FineWeb's schema")
    ap.add_argument("--dataset", default="HuggingFaceFW/fineweb")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="an existing SentencePiece .model or Hugging Face tokenizer.json "
                                        "(else a SentencePiece BPE is trained)")
    ap.add_argument("--eos-token", help="tokenizer.json: the token that ends each document (default: the first "
                                        "of <|endoftext|>, </s>, <|end_of_text|>, <eos>, <|im_end|>, [SEP] it holds)")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--dtype", choices=["uint16", "uint32"], help="default: uint16 when the vocabulary fits")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--docs-per-shard", type=int, default=4096)
    ap.add_argument("--tokenizer-sample-docs", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--skip-empty", action="store_true", help="drop empty documents instead of failing")
    ap.add_argument("--max-shards", type=int, help="stop after this many shards (continue later)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a folder prepared (or started) with other settings: deletes tokens/, plan.json "
                         "and the tokenizer preparation wrote (never the --tokenizer file), then prepares afresh")
    args = ap.parse_args(argv)
    t0 = time.time()
    meta = prepare(args.out, files=args.files, name=args.name, dataset=args.dataset, tokenizer=args.tokenizer,
                   vocab_size=args.vocab_size, dtype=args.dtype, val_fraction=args.val_fraction,
                   docs_per_shard=args.docs_per_shard, tokenizer_sample_docs=args.tokenizer_sample_docs,
                   workers=args.workers, text_column=args.text_column, skip_empty=args.skip_empty,
                   max_shards=args.max_shards, overwrite=args.overwrite,
                   eos_token=args.eos_token)
    if not meta.get("complete"):
        print(f"stopped after {meta['shards']} shards; run the same command again to continue")
        return 0
    c = meta["counts"]
    print(f"{args.out}/tokens: train {c['train']['documents']:,} docs / {c['train']['tokens']:,} tokens, "
          f"val {c['val']['documents']:,} docs / {c['val']['tokens']:,} tokens ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
