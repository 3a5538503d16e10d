"""A disk that fills during a save: every rank stops with exit code 74 and a message that names
the checkpoint that could not be written and the last complete one, which stays intact; nothing
half-written is published and the run resumes from the intact one. The file system is made to
refuse writes with the per-process file-size limit (``ulimit -f``: EFBIG, as ENOSPC or EDQUOT
would), on one rank only in the DP2 run: the other rank's writes succeed and it must not hang."""
import os
import subprocess
import sys

import pytest

from fpscale.train.checkpoint import published, verify
from tests.parallel.launch import ROOT, torchrun_command
from tests.train.test_checkpoint import BASE

pytestmark = pytest.mark.multiprocess


def run(cmd: list[str], limit_rank: int | None, tmp_path) -> subprocess.CompletedProcess:
    """``cmd`` (launch/pretrain.py and its arguments) on one process or two under torchrun; the
    rank ``limit_rank`` may write no file over 64 KiB."""
    wrapper = tmp_path / "limited.sh"
    wrapper.write_text(f'#!/bin/bash\nif [ "${{RANK:-0}}" = "{limit_rank}" ]; then ulimit -f 64; fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(wrapper), *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def torchrun(*args: str, program: str = sys.executable) -> list[str]:
    """torchrun on 2 processes of ``program launch/pretrain.py args``, less the leading python
    (``run``'s wrapper supplies it)."""
    return torchrun_command(2, "--no-python", program, "launch/pretrain.py", *args)[1:]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_during_a_save_keeps_the_last_complete_checkpoint(tmp_path, nproc):
    args = ["--config", "configs/tiny_mixed.yaml", *BASE, "parallel.zero_stage=1", f"train.out_dir={tmp_path}",
            "name=full"]
    if nproc == 1:
        args += ["train.global_batch=4"]
    cmd = (lambda *a: ["launch/pretrain.py", *a]) if nproc == 1 else torchrun
    first = run(cmd(*args, "train.stop_at=2"), None, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    limited = 1 if nproc == 2 else 0
    if nproc == 2:            # rank 1 is limited through torchrun: the wrapper runs torchrun unlimited,
        full = run(torchrun(*args, program=str(tmp_path / "limited.sh")), limited, tmp_path)   # each worker again
    else:
        full = run(cmd(*args), limited, tmp_path)
    root = tmp_path / "full" / "checkpoints"
    out = full.stdout + full.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert full.returncode != 0 and errors, out[-3000:]
    if nproc == 1:
        assert full.returncode == 74
    else:
        assert len(errors) == 2 and "exitcode  : 74" in out, out[-3000:]     # both ranks, neither hung
    for line in errors:
        assert "checkpoint step_00000004 could not be written" in line and "File too large" in line
        assert f"the last complete checkpoint {root / 'step_00000002'} is intact" in line
    assert [os.path.basename(f) for f in published(str(root))] == ["step_00000002"]
    assert verify(str(root / "step_00000002")) is None
    assert not (root / ".partial" / "step_00000004").exists()
    resumed = run(cmd(*args), None, tmp_path)                         # space again: it continues
    assert resumed.returncode == 0 and "step_00000002" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert os.path.basename(published(str(root))[0]) == "step_00000008"
