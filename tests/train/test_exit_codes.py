"""A user's mistake (config, path, layout, data, checkpoint) is one line and exit 2; a bug inside
fpscale keeps its traceback and exits 1, even when it is a ValueError; fault specs are checked."""
import subprocess
import sys
import time

import pytest

from fpscale.cli import reported
from fpscale.errors import EXIT_USER, CheckpointError, ConfigError, DataError, LayoutError, StorageFull
from fpscale.train.faults import Fault
from tests.train.test_pretrain_cli import OVERRIDES, ROOT


@pytest.mark.parametrize("error", [ConfigError("train.lr", "must be > 0"), DataError("shard missing"),
                                   LayoutError("4 ranks"), CheckpointError("step_1 fails its sha256")])
def test_user_errors_are_one_line_and_exit_2(error, capsys):
    def main(argv=None):
        raise error
    assert reported(main)() == EXIT_USER
    err = capsys.readouterr().err
    assert err == f"error: {error}\n"


def test_a_full_disk_has_its_own_code_and_anything_else_propagates(capsys):
    def full(argv=None):
        raise StorageFull("no space")

    def bug(argv=None):
        raise ValueError("a bug, not a config mistake")
    assert reported(full)() == 74
    with pytest.raises(ValueError, match="a bug"):      # the interpreter prints it and exits 1
        reported(bug)()


def test_the_error_line_is_one_write_so_ranks_sharing_stderr_never_share_a_line(tmp_path):
    """Two processes, unbuffered (``python -u``, as the CI run that put two ranks' messages on one
    line), each printing 300 error lines into one file: every line is one whole message."""
    code = ("import sys, time; from fpscale.errors import print_error\n"
            "while time.time() < float(sys.argv[2]): pass\n"         # both start together
            "for i in range(3000): print_error(sys.argv[1] * 200)")
    log, start = tmp_path / "both.log", f"{time.time() + 3:.3f}"
    with open(log, "wb") as fh:
        procs = [subprocess.Popen([sys.executable, "-u", "-c", code, tag, start], cwd=ROOT, stderr=fh)
                 for tag in "ab"]
        for p in procs:
            assert p.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 6000 and set(lines) == {"error: " + "a" * 200, "error: " + "b" * 200}


def test_fault_specs_parse_and_bad_ones_say_the_form():
    f = Fault.parse("SIGKILL@save:8+0.25,rank=3")
    assert (f.signal.name, f.phase, f.step, f.delay_s, f.rank) == ("SIGKILL", "save", 8, 0.25, 3)
    assert Fault.parse("SIGTERM@step:2") == Fault(f.signal.__class__["SIGTERM"], "step", 2, 0.0, 0)
    with pytest.raises(ValueError, match="SIGNAL@PHASE:STEP"):
        Fault.parse("kill_in_save:4")


def pretrain(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch/pretrain.py", "--config", "configs/tiny_attn.yaml", *OVERRIDES, *args]
    if code:          # run main() after ``code`` (which patches fpscale) in the same interpreter
        cmd = [sys.executable, "-c", f"{code}\nimport sys\nfrom fpscale.cli.pretrain import main\n"
                                      f"sys.exit(main({[*cmd[2:]]!r}))"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_pretrain_user_errors_exit_2_with_one_line(tmp_path):
    cases = [(["data.source=shards", f"data.path={tmp_path}/none"], "no prepared token shards"),
             ([f"train.resume={tmp_path}/missing"], "is not a folder"),
             (["train.grad_accum=3"], "train.global_batch")]
    for args, says in cases:
        proc = pretrain(f"train.out_dir={tmp_path}", *args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and says in proc.stderr, (args, proc.stderr[-2000:])


@pytest.mark.slow
def test_a_bug_in_fpscale_keeps_its_traceback_and_exits_1(tmp_path):
    """The old CLI turned every ValueError while the trainer was built into 'error: ...' and exit 2."""
    for where in ("build_datasets", "Trainer.train_step"):        # while building, while training
        patch = ("import fpscale.train.trainer as t\n"
                 "def broken(*args):\n    raise ValueError('an index computed wrongly')\n"
                 f"t.{where} = broken")
        proc = pretrain(f"train.out_dir={tmp_path}", code=patch)
        assert proc.returncode == 1, (where, proc.stderr[-2000:])
        assert "Traceback" in proc.stderr and "in broken" in proc.stderr, (where, proc.stderr[-2000:])


@pytest.mark.slow
def test_evaluate_and_convert_name_a_missing_checkpoint(tmp_path):
    for cmd in (["launch/evaluate.py", "--checkpoint", str(tmp_path / "nope")],
                ["launch/convert.py", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]):
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nope" in proc.stderr, proc.stderr[-2000:]
