"""Start multi-process runs for the tests with a timeout, and clean up what they started."""
import json
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (stderr into stdout); on timeout kill the whole group
    and fail; with ``check``, a nonzero exit fails too. Nothing of the group outlives the call."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout} s (killed):\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` local processes on a free port, then
    ``args`` (a script and its arguments, or ``--no-python`` and a program)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]


def torchrun(nproc: int, script: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return run(torchrun_command(nproc, script, *args), timeout)


def layout_cases(nproc: int, out_dir, cases: dict[str, list[str]], timeout_each: float = 300) -> dict[str, list]:
    """tests/parallel/run_layout.py's ``cases`` ({name: its arguments}) one after the other in ONE
    launch of ``nproc`` ranks (``nproc`` 1: one plain process, as one_process_reference), each into its
    own folder ``out_dir/name``: what a launch per case proved, without a start per case. The launch's
    timeout is the cases' (``timeout_each``) summed. Every case's ranks (read_ranks), by name."""
    args: list[str] = []
    for name, case in cases.items():
        path = os.path.join(str(out_dir), name)
        os.makedirs(path)
        args += [*(["--then"] if args else []), path, *case]
    script = "tests/parallel/run_layout.py"
    run(torchrun_command(nproc, script, *args) if nproc > 1 else [sys.executable, script, *args],
        timeout=timeout_each * len(cases))
    return {name: read_ranks(os.path.join(str(out_dir), name)) for name in cases}


def one_process_reference(out_dir: str, *args: str) -> dict:
    """tests/parallel/run_layout.py on one process (the reference a layout is compared with)."""
    run([sys.executable, "tests/parallel/run_layout.py", out_dir, *args], timeout=300)
    (ref,) = read_ranks(out_dir)
    return ref


def read_ranks(out_dir: str) -> list[dict]:
    files = sorted(f for f in os.listdir(out_dir) if f.startswith("rank"))
    return [json.load(open(os.path.join(out_dir, f))) for f in files]


def assert_deep_supervision_matches(ranks: list[dict], reference: dict) -> None:
    """run_layout.py's ``ds=1`` model (a looped core with deep supervision, randomised caps) on a layout
    against one process over 5 steps: losses and gradient norms (fp32, 1e-5 / 1e-4 relative), the
    iterations and the supervised windows of every step, on every rank."""
    import pytest
    want = reference["deep_supervision"]
    assert any(s["windows"][0] > 0 for s in want)          # some step was supervised in windows
    for r in ranks:
        got = r["deep_supervision"]
        assert [(s["iterations"], s["windows"]) for s in got] == [(s["iterations"], s["windows"]) for s in want]
        for a, b in zip(got, want):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
