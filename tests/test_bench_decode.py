"""bench/decode.py at its test size (--quick: T 8, 4 new tokens): every tiny config in both cache modes, and
its device-independent columns hold issue 51's goal (fixed_point's cache within 1.25x of tiny_attn's per
attention block; exact's no smaller)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow          # a child process that imports torch and builds every tiny config


def test_every_tiny_config_decodes_in_both_modes_and_fixed_point_is_a_plain_cache(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "bench/decode.py", "--quick", "--out", str(out)], cwd=ROOT, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ms_per_token" in proc.stdout
    rows = {(r["config"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    configs = {p.stem for p in (ROOT / "configs").glob("tiny_*.yaml")}
    assert set(rows) == {(c, m) for c in configs for m in ("exact", "fixed_point")}
    plain = rows["tiny_attn", "exact"]["per_block_kb"]
    for name in ("tiny_fpsa", "tiny_looped", "tiny_attractor"):
        assert rows[name, "fixed_point"]["per_block_kb"] <= 1.25 * plain, (name, rows[name, "fixed_point"], plain)
    for name in configs:
        assert rows[name, "fixed_point"]["cache_bytes"] <= rows[name, "exact"]["cache_bytes"], name
        assert rows[name, "exact"]["ms_per_token"] > 0
