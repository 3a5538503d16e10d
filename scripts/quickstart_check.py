"""The end of the quickstart: the figure it measured beside the one expected (scripts/quickstart_expected.json,
the README's), e.g. "validation perplexity: expected 172.05, measured 172.05".

    python scripts/quickstart_check.py [--run runs/tiny_mixed] [--expected scripts/quickstart_expected.json]

Reads the run's last validation record (metrics.jsonl) and the corpus it was built from
(cache/corpus/raw/SOURCES.json). Exit status 0 either way (the quickstart's run succeeded); a
figure that differs is said loudly, with the likely causes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = os.path.join(ROOT, "scripts", "quickstart_expected.json")


def expected_figure(path: str = EXPECTED) -> dict:
    with open(path) as fh:
        return json.load(fh)


def last_validation(run_dir: str) -> dict:
    record = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("kind") == "val":
                record = row
    if record is None:
        raise SystemExit(f"no validation record in {run_dir}/metrics.jsonl")
    return record


def compare(expected: dict, record: dict) -> tuple[list[str], bool]:
    """Lines "<what>: expected X, measured Y" (figures rounded as the README states them) and
    whether every figure matches."""
    lines, same = [], True
    want, got = f"{expected['val_ppl']:.2f}", f"{record['val_ppl']:.2f}"
    lines.append(f"validation perplexity: expected {want}, measured {got}")
    same &= want == got
    by_type = {name.split(".")[-1]: st for name, st in record.get("layers", {}).items()}
    for kind, value in expected["iterations"].items():
        want = f"{value:.2f}"
        got = f"{by_type[kind]['iters_mean']:.2f}" if kind in by_type else "absent"
        lines.append(f"{kind} iterations at validation: expected {want}, measured {got}")
        same &= want == got
    return lines, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=os.path.join(ROOT, "runs", "tiny_mixed"))
    ap.add_argument("--expected", default=EXPECTED)
    ap.add_argument("--corpus", default=os.path.join(ROOT, "cache", "corpus", "raw", "SOURCES.json"))
    args = ap.parse_args()
    expected = expected_figure(args.expected)
    lines, same = compare(expected, last_validation(args.run))
    print("\n".join("[quickstart] " + line for line in lines))
    if same:
        print("[quickstart] the figure matches the README's")
        return 0
    pinned = expected["corpus"]["python3.11-doc"]
    try:
        with open(args.corpus) as fh:
            used = json.load(fh).get("pydoc", {}).get("version", "unknown")
    except OSError:
        used = "unknown"
    why = (f"the corpus was built from python3.11-doc {used}, not the pinned {pinned}" if used != pinned else
           "the corpus is the pinned one: a change of code since the figure was measured, config overrides, "
           "another process count or thread count, or another CPU's floating-point summation order")
    print(f"[quickstart] THE FIGURE DIFFERS from the README's: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
