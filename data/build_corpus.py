"""Build the bundled default corpus (see fpscale/data/corpus.py).

    python data/build_corpus.py [--out cache/corpus/raw]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fpscale.data.corpus import build_corpus  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cache/corpus/raw")
    args = ap.parse_args()
    t0 = time.time()
    try:
        path = build_corpus(args.out)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"corpus: {path} ({os.path.getsize(path) / 2 ** 20:.1f} MiB, {time.time() - t0:.1f} s)")
