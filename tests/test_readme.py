"""The README's commands run as written.

Every fenced command block of README.md is read line by line. A command that starts a fpscale script
(``python launch/X.py``, ``python data/X.py``, ``deepspeed ... launch/X.py``, ``torchrun ... launch/X.py``,
``sbatch launch/slurm/X``) must name a script that exists, and its ``--config`` with its ``key=value``
overrides must load (the same validation a launch does first). The block marked
``<!-- readme-test: run -->`` is run as written, in a scratch folder beside links to the repository's
launch/ and configs/: seconds on one CPU process.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"(<!-- readme-test: run -->\n)?```[a-z]*\n(.*?)```", re.S)
LAUNCHERS = ("python", "deepspeed", "torchrun", "sbatch", "srun")


def blocks() -> list[tuple[bool, list[str]]]:
    out = []
    for m in BLOCK.finditer(README):
        lines = [ln.split("  #")[0].strip() for ln in m.group(2).splitlines()]
        out.append((m.group(1) is not None, [ln for ln in lines if ln]))
    return out


def commands() -> list[list[str]]:
    """Every README line that launches one of fpscale's scripts, as its argument list."""
    found = []
    for _, lines in blocks():
        for line in lines:
            if not line.startswith(LAUNCHERS) or line.startswith("python -m"):
                continue
            argv = shlex.split(line)
            if any(a.endswith(".py") or "/slurm/" in a for a in argv):
                found.append(argv)
    return found


def script_of(argv: list[str]) -> str:
    return next(a for a in argv if a.endswith(".py") or a.endswith(".sbatch"))


def test_the_readme_has_commands_and_one_runnable_block():
    assert len(commands()) >= 10
    assert sum(run for run, _ in blocks()) == 1


@pytest.mark.parametrize("argv", commands(), ids=lambda a: " ".join(a)[:80])
def test_every_readme_command_names_a_script_and_a_config_that_loads(argv):
    from fpscale import load_config

    assert (ROOT / script_of(argv)).is_file(), f"{script_of(argv)} does not exist"
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    if config is None and argv[0] == "sbatch":          # sbatch SCRIPT CONFIG [overrides]
        config = next((a for a in argv if a.endswith(".yaml")), None)
    if config is None:
        return
    after = argv[argv.index(config) + 1:]
    overrides = [a for a in after if "=" in a and not a.startswith("-")]
    load_config(str(ROOT / config), overrides)


@pytest.mark.slow
def test_the_runnable_block_runs_as_written(tmp_path):
    """The marked block, each line a process with a deadline, killed with its process group on timeout."""
    (lines,) = [lines for run, lines in blocks() if run]
    for name in ("launch", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "python":
            argv[0] = sys.executable
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"timed out: {line}\n{out[-3000:]}")
        assert proc.returncode == 0, f"{line}\n{out[-3000:]}"
    assert (tmp_path / "runs" / "readme_try" / "exported" / "model.safetensors").is_file()
