"""scripts/setup.sh fails loudly: a pip install that fails stops the set-up with the failing
command, pip's own error, and pip's exit status (it used to be swallowed, then exit 1 in silence)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_setup_with_a_broken_requirement_exits_nonzero_and_prints_the_pip_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), repo / "scripts")
    shutil.copytree(os.path.join(ROOT, "fpscale"), repo / "fpscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "README.md"), repo)
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    broken = pyproject.replace('"numpy>=1.24",', '"numpy==0.0.0.1",')      # no such release
    assert broken != pyproject
    (repo / "pyproject.toml").write_text(broken)
    # the project's environment, so that torch and DeepSpeed are there; pip fails while resolving,
    # before it changes anything in it
    os.symlink(os.path.join(ROOT, ".venv"), repo / ".venv")
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIP_RETRIES": "0", "PIP_TIMEOUT": "30"})
    assert proc.returncode != 0
    assert "[setup] FAILED" in proc.stderr and "pip" in proc.stderr and "install" in proc.stderr, proc.stderr
    assert "numpy==0.0.0.1" in proc.stderr, proc.stderr               # pip's own words on what failed
    assert "[setup] ready" not in proc.stdout
