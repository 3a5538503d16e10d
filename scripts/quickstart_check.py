"""The end of the quickstart: the figure it measured beside the one expected (scripts/quickstart_expected.json,
the README's), e.g. "validation perplexity: expected 181.33, measured 181.33".

    python scripts/quickstart_check.py [--run runs/tiny_mixed] [--expected scripts/quickstart_expected.json]
    python scripts/quickstart_check.py --strict    # CI (tests/test_quickstart_figure.py): exit 1 if it differs
    python scripts/quickstart_check.py --update    # after a change that moves the figure: write the measured
                                                   # figure into the JSON, README.md and docs/quickstart.md

Reads the run's last validation record (metrics.jsonl) and the corpus it was built from
(cache/corpus/raw/SOURCES.json). Figures compare as printed (2 decimals). Without --strict the exit status is
0 either way (the quickstart's run succeeded); a figure that differs is said loudly, with the likely causes.
Re-measuring after a change is two commands (RE_MEASURE), then a commit of the three files.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = os.path.join(ROOT, "scripts", "quickstart_expected.json")
PAGES = ("README.md", "docs/quickstart.md")     # the pages that state the figure
RE_MEASURE = "bash scripts/quickstart.sh && .venv/bin/python scripts/quickstart_check.py --update"


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


def measured_figure(record: dict) -> tuple[str, dict[str, str]]:
    """(perplexity, {layer type: iterations}) of a validation record, as printed ("absent": no such layer)."""
    by_type = {name.split(".")[-1]: st for name, st in record.get("layers", {}).items()}
    return f"{record['val_ppl']:.2f}", {kind: f"{st['iters_mean']:.2f}" for kind, st in by_type.items()}


def figures(expected: dict, record: dict) -> list[tuple[str, str, str]]:
    """(what, expected, measured) per figure, rounded as the README states them ("absent": no such layer)."""
    ppl, iters = measured_figure(record)
    rows = [("validation perplexity", f"{expected['val_ppl']:.2f}", ppl)]
    for kind, value in expected["iterations"].items():
        rows.append((f"{kind} iterations at validation", f"{value:.2f}", iters.get(kind, "absent")))
    return rows


def compare(expected: dict, record: dict) -> tuple[list[str], bool]:
    """Lines "<what>: expected X, measured Y" and whether every figure matches."""
    rows = figures(expected, record)
    return [f"{what}: expected {want}, measured {got}" for what, want, got in rows], all(w == g for _, w, g in rows)


STATED_PPL = re.compile(r"validation perplexity \**(\d+\.\d+)")


def stated_spans(text: str, kinds) -> dict[str, tuple[int, int]]:
    """Where a page states the figure: the first "validation perplexity N.NN" (bold allowed) and each layer
    type's "<type> N.NN" within the 1,000 characters after it. {"val_ppl" or type: (start, end)}."""
    found = STATED_PPL.search(text)
    if not found:
        return {}
    spans = {"val_ppl": found.span(1)}
    for kind in kinds:
        it = re.compile(rf"\b{kind} (\d+\.\d+)").search(text, found.end(), found.end() + 1000)
        if it:
            spans[kind] = it.span(1)
    return spans


def update(record: dict, expected_path: str = EXPECTED, root: str = ROOT) -> list[str]:
    """Write the measured figure into the expected JSON and the pages that state it; the files changed."""
    expected = expected_figure(expected_path)
    ppl, iters = measured_figure(record)
    missing = [kind for kind in expected["iterations"] if kind not in iters]
    if missing:
        raise SystemExit(f"the run has no {', '.join(missing)} layer: not the quickstart's config")
    new = {"val_ppl": ppl, **{kind: iters[kind] for kind in expected["iterations"]}}
    changed = []
    for page in PAGES:
        path = os.path.join(root, page)
        with open(path) as fh:
            text = fh.read()
        spans = stated_spans(text, expected["iterations"])
        if set(spans) != set(new):
            raise SystemExit(f"{page} does not state the whole figure (found {sorted(spans)}): edit it by hand")
        out = text
        for key, (start, end) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
            out = out[:start] + new[key] + out[end:]
        if out != text:
            with open(path, "w") as fh:
                fh.write(out)
            changed.append(page)
    figure = {"val_ppl": float(ppl), "iterations": {kind: float(iters[kind]) for kind in expected["iterations"]}}
    if {k: expected[k] for k in figure} != figure:
        with open(expected_path, "w") as fh:
            json.dump(expected | figure, fh, indent=1)
            fh.write("\n")
        changed.append(os.path.relpath(expected_path, root))
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=os.path.join(ROOT, "runs", "tiny_mixed"))
    ap.add_argument("--expected", default=EXPECTED)
    ap.add_argument("--corpus", default=os.path.join(ROOT, "cache", "corpus", "raw", "SOURCES.json"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--strict", action="store_true", help="exit 1 when the figure differs (CI)")
    mode.add_argument("--update", action="store_true", help="write the measured figure into the expected JSON, "
                                                            f"{' and '.join(PAGES)}")
    args = ap.parse_args()
    record = last_validation(args.run)
    if args.update:
        changed = update(record, args.expected)
        print(f"[quickstart] the figure written into {', '.join(changed)}: commit them with the change that moved it"
              if changed else "[quickstart] the figure is already the stated one: nothing to update")
        return 0
    expected = expected_figure(args.expected)
    lines, same = compare(expected, record)
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
    differs = "; ".join(f"{what} {got} against {want}" for what, want, got in figures(expected, record) if want != got)
    print(f"[quickstart] THE FIGURE DIFFERS from the README's ({differs}): {why}. If a change moved it, "
          f"re-measure and commit the new figure with it: {RE_MEASURE}", file=sys.stderr)
    return 1 if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
