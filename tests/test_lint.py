"""The repository's own checks, as pyproject.toml configures them: ruff (pyflakes, pycodestyle,
import order) over every Python file, mypy over fpscale/solvers and fpscale/parallel. Both come
with the dev extras that scripts/setup.sh installs."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def check(*cmd: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named" not in proc.stderr, f"{cmd[0]} is not installed: bash scripts/setup.sh installs it"
    assert proc.returncode == 0, f"{' '.join(cmd)} found problems:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"


def test_ruff_is_clean():
    check("ruff", "check", ".")


@pytest.mark.slow
def test_mypy_is_clean_on_solvers_and_parallel():
    check("mypy")
