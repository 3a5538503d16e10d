"""bench/checkpointing.py at a tiny size on CPU: it runs, and its saved bytes follow the modes
(``block`` keeps an attn block's input only; fpsa and fpmamba recompute their MLP, a looped core
nothing)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_saved_bytes_per_block_and_mode(tmp_path):
    out = tmp_path / "checkpointing.json"
    cmd = [sys.executable, "bench/checkpointing.py", "--device", "cpu", "--d", "32", "--heads", "2", "--T", "16",
           "--B", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(r["layer"], r["mode"]): r["saved_bytes"] for r in json.loads(out.read_text())["rows"]}
    assert rows["attn", "block"] == 4 * 2 * 16 * 32 < rows["attn", "mlp"] < rows["attn", "none"]
    for layer in ("fpsa", "fpmamba+mlp"):
        assert rows[layer, "block"] == rows[layer, "mlp"] < rows[layer, "none"]
    assert rows["looped", "none"] == rows["looped", "mlp"] == rows["looped", "block"]
