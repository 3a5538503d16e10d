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


# ---- every documented command, as written (its --help form) -------------------------------------------
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")), "experiments/README.md"]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
COMMAND = re.compile(r"^((?:[A-Z_]+=\S+\s+)*)(python3?|\.venv/bin/python|deepspeed|torchrun|bash|sbatch)\s+(.*)$")


def documented_scripts() -> dict[tuple[str, str], list[str]]:
    """{(environment prefix, script): the pages} (documented_commands, without the options)."""
    return {key: [page for page, _ in uses] for key, uses in documented_commands().items()}


def documented_options(env: str, script: str) -> set[str]:
    """The ``--options`` the pages give ``script`` (after its path; ``--name=value`` as ``--name``)."""
    return {w.split("=")[0] for _, words in documented_commands()[env, script] for w in words if w.startswith("--")}


def documented_commands() -> dict[tuple[str, str], list[tuple[str, list[str]]]]:
    """{(environment prefix, script): [(page, the words after the script)]} for every command of README.md,
    docs/*.md and experiments/README.md (fenced lines and inline code, each part of a ``&&`` / ``;`` chain) that
    starts one of fpscale's scripts (``[VAR=value ...] python|deepspeed|torchrun|bash|sbatch ... path.py|.sh|
    .sbatch``). Patterns (``bench/*.py``, ``experiments/<name>.py``) and ``python -m`` commands are left out."""
    found: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}
    for page in PAGES:
        text = (ROOT / page).read_text()
        spans = [ln.split("  #")[0].strip() for m in FENCE.finditer(text) for ln in m.group(1).splitlines()]
        spans += [m.group(1).strip() for m in INLINE.finditer(FENCE.sub("", text))]
        for span in spans:
            for part in re.split(r"\s*(?:&&|;|\|)\s*", span):
                m = COMMAND.match(part)
                if not m or m.group(3).startswith("-m "):          # python -m pytest FILE: not FILE's entry point
                    continue
                words = m.group(3).split()
                at = next((i for i, w in enumerate(words) if re.search(r"\.(py|sh|sbatch)$", w)), None)
                if at is not None and not re.search(r"[*<>]", words[at]):
                    found.setdefault((m.group(1).strip(), words[at]), []).append((page, words[at + 1:]))
    return found


def test_the_pages_document_scripts():
    scripts = {script for _, script in documented_scripts()}
    assert {"launch/pretrain.py", "experiments/optimizers.py", "scripts/quickstart.sh"} <= scripts, scripts
    assert len(scripts) >= 30


@pytest.mark.parametrize("env,script", sorted(documented_scripts()), ids=lambda v: v or "-")
def test_every_documented_script_exists(env, script):
    assert (ROOT / script).is_file(), f"{script} (in {', '.join(sorted(set(documented_scripts()[env, script])))}) " \
                                      "does not exist"


@pytest.mark.slow
@pytest.mark.parametrize("env,script", sorted(k for k in documented_scripts() if k[1].endswith(".py")),
                         ids=lambda v: v or "-")
def test_every_documented_python_command_runs_as_written(env, script):
    """``[VAR=value] python SCRIPT --help`` from the checkout with no PYTHONPATH but the command's own: an entry
    point that cannot import what it needs (``No module named 'experiments'``) fails here, and so does an
    ``--option`` a page gives the script that its --help does not list (renamed or gone). The --quick runs of
    the experiments are tests/experiments; the README's runnable block is test_the_runnable_block_runs_as_written."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assigned = dict(a.split("=", 1) for a in env.split())
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**base, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **assigned})
    pages = ", ".join(sorted(set(documented_scripts()[env, script])))
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), \
        f"{env} python {script} --help (documented in {pages}) exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    offered = set(re.findall(r"(?<![\w-])--[\w-]+", proc.stdout))
    unknown = sorted(documented_options(env, script) - offered)
    assert not unknown, f"{script} has no option {', '.join(unknown)} (documented in {pages}):\n{proc.stdout[-2000:]}"


def test_every_results_bullet_names_its_command():
    """The README's "Results at a glance": a bullet with a figure names the command that measures it (or the page
    that gives every row's command: docs/experiments.md, docs/benchmarks.md), and that command is a documented
    script (so test_every_documented_python_command_runs_as_written starts it); and the commit it was measured at
    (or committed in), which this checkout's history resolves where it has its history (tests/test_doc_figures.py
    holds the pages' figure tables to the same)."""
    from tests.test_doc_figures import hexes, known_commits
    section = README.split("## Results at a glance", 1)[1].split("\n## ", 1)[0]
    bullets = [b for b in re.split(r"\n\* ", "\n" + section) if b.strip()]
    assert len(bullets) >= 4
    scripts = {script for _, script in documented_scripts()}
    for bullet in bullets:
        if not re.search(r"\d", bullet):
            continue
        named = [w for cmd in INLINE.findall(bullet) for w in cmd.split() if w.endswith(".py")]
        assert named or re.search(r"docs/(experiments|benchmarks)\.md", bullet), f"no command for: {bullet[:120]}"
        assert set(named) <= scripts, (named, bullet[:120])
        commits = known_commits(hexes(bullet))
        assert hexes(bullet) if commits is None else commits, f"no commit for: {bullet[:120]}"
