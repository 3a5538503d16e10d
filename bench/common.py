"""Shared helpers for the benchmarks: a results folder, a table printer, JSON output. Every bench
script imports this module before fpscale: it puts this checkout on ``sys.path``, so that
``python bench/X.py`` runs without installing fpscale (a GPU node's own torch environment)."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.3e}"
    return "-" if v is None else str(v)


def write_json(name: str, payload: dict, out: str | None = None, quiet: bool = False) -> Path:
    """Write ``payload`` atomically (a reader, or a kill mid-write, never sees half a file)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {os.path.relpath(path)}")
    return path
