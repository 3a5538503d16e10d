"""launch/slurm/*.sbatch on a real local SLURM cluster: two nodes on this host, 2 tasks per node.

Skipped (with the reason) only where SLURM cannot be installed. The sbatch scripts run unchanged;
the command line only sizes the job for this GPU-less 2-core machine (sbatch options override the
script's #SBATCH lines) and points train.out_dir at a temporary folder.
"""
import json
import os
import sys
import time

import pytest

from tests.parallel.launch import ROOT
from tests.slurm.cluster import LocalSlurm, install_reason

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm]
TRAIN = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32",
         "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=16", "train.warmup=2",
         "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=4", "solver.forward.stop_quantile=0.0",
         "parallel.tp=2", "parallel.zero_stage=1"]
SIZE = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_reason()
    if reason:
        pytest.skip(reason)
    with LocalSlurm(str(tmp_path_factory.mktemp("slurm"))) as c:
        yield c


def job_env(tmp_path) -> dict:
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "FPSCALE_PYTHON": sys.executable,
            "FPSCALE_ROOT": ROOT}


def train_records(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


STEPS = 16


@pytest.fixture(scope="module")
def straight_job(cluster, tmp_path_factory):
    """pretrain.sbatch on 2 nodes x 2 tasks (TP2 x DP2), STEPS steps uninterrupted: the first test's job,
    and the run the requeued job must equal (one job for both, not a second uninterrupted launch).
    (run folder, the job's log, its scontrol record)"""
    tmp_path = tmp_path_factory.mktemp("straight")
    out = tmp_path / "job.out"
    job = cluster.sbatch([*SIZE, f"--output={out}", "launch/slurm/pretrain.sbatch", "configs/tiny_mixed.yaml",
                          *TRAIN, f"train.steps={STEPS}", f"train.out_dir={tmp_path}", "name=sl"],
                         env=job_env(tmp_path), cwd=ROOT)
    info = cluster.wait(job, timeout=400)
    return tmp_path, out.read_text(), info


def test_pretrain_sbatch_trains_tp2_dp2_on_two_nodes(cluster, straight_job, tmp_path):
    run_root, log, info = straight_job
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "world 4 (dp 2" in log and "master 127.0.0.1:" in log
    ckpt = run_root / "sl" / "checkpoints" / f"step_{STEPS:08d}"
    ranks = sorted(f.name for f in ckpt.iterdir() if f.name.startswith("fpscale_rank"))
    assert ranks == [f"fpscale_rank{r:05d}.pt" for r in range(4)]           # four distinct RANKs
    import torch
    layout = sorted((s["tp_rank"], s["dp_rank"]) for s in
                    (torch.load(ckpt / r, weights_only=True) for r in ranks))
    assert layout == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(train_records(run_root / "sl")) == list(range(1, STEPS + 1))
    assert (run_root / "sl" / "final" / "model.safetensors").exists()

    # the evaluation job reads that checkpoint and writes its report
    eval_out = tmp_path / "eval.out"
    job = cluster.sbatch(["--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={eval_out}",
                          "launch/slurm/evaluate.sbatch", str(ckpt), "--out", str(tmp_path / "report")],
                         env=job_env(tmp_path), cwd=ROOT)
    info = cluster.wait(job, timeout=300)
    assert info["JobState"] == "COMPLETED", eval_out.read_text()[-3000:]
    report = json.load(open(tmp_path / "report" / "eval.json"))
    assert report["step"] == STEPS and report["saved_layout"]["tp"] == 2
    assert (tmp_path / "report" / "iterations.png").exists()


def test_usr1_saves_requeues_and_the_requeued_job_continues_exactly(cluster, straight_job, tmp_path):
    out = tmp_path / "job.out"
    job = cluster.sbatch([*SIZE, f"--output={out}", "launch/slurm/pretrain.sbatch", "configs/tiny_mixed.yaml",
                          *TRAIN, f"train.steps={STEPS}", f"train.out_dir={tmp_path}", "name=pre"],
                         env=job_env(tmp_path), cwd=ROOT)
    metrics = tmp_path / "pre" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.time() < deadline and cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), out.read_text()
        time.sleep(0.2)
    cluster.scancel("--signal=USR1", job)                   # what --signal=USR1@300 sends before the limit
    cluster.start_requeued_now(job, timeout=300)
    info = cluster.wait(job, timeout=600, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, log[-4000:], cluster.logs())
    assert "preempted" in log and "requeueing" in log and "resumed from" in log, log[-4000:]
    saved_at = int(log.split("preempted (signal")[1].split("saved step ")[1].split()[0])
    assert 1 <= saved_at < STEPS

    # the same run without interruption, on the same layout: the first test's job
    run_root, straight_log, straight_info = straight_job
    assert straight_info["JobState"] == "COMPLETED", straight_log[-3000:]
    got, want = train_records(tmp_path / "pre"), train_records(run_root / "sl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == want[step]["loss"], step


def test_srun_python_reads_slurm_variables_itself(cluster, tmp_path):
    """No launcher, no RANK / MASTER_ADDR: pretrain.py maps SLURM_PROCID / SLURM_LOCALID /
    SLURM_NTASKS and finds the first node's address with scontrol."""
    out = tmp_path / "srun.out"
    cmd = (f"srun {sys.executable} launch/pretrain.py --config configs/tiny_mixed.yaml "
           + " ".join(TRAIN[:-2]) + f" train.steps=2 train.out_dir={tmp_path} name=srun")
    env = {k: v for k, v in job_env(tmp_path).items() if k != "FPSCALE_PYTHON"}
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10", f"--output={out}",
                          f"--chdir={ROOT}", "--wrap", cmd], env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=300)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "world 2 (dp 2" in log
    ckpt = tmp_path / "srun" / "checkpoints" / "step_00000002"
    assert sorted(f.name for f in ckpt.iterdir() if f.name.startswith("fpscale_rank")) == \
        ["fpscale_rank00000.pt", "fpscale_rank00001.pt"]


FAKE_SRUN = """#!/bin/bash
{ printf 'arg %s\\n' "$@"; echo "OMP_NUM_THREADS=${OMP_NUM_THREADS-unset}"; } > "$FAKE_SRUN_OUT"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$2" in hostnames) echo node1 ;; node) echo "NodeName=node1 NodeAddr=10.1.2.3 State=IDLE" ;; esac
"""


@pytest.mark.parametrize("script", ["pretrain.sbatch", "evaluate.sbatch"])
@pytest.mark.parametrize("cpus,user_omp,want_flag,want_omp", [
    ("8", None, "--cpus-per-task=8", "8"),          # srun (Slurm >= 22.05) would not inherit it
    ("8", "3", "--cpus-per-task=8", "3"),           # the user's OMP_NUM_THREADS wins
    (None, None, None, "unset"),                    # no --cpus-per-task asked: nothing passed on
])
def test_the_sbatch_scripts_pass_cpus_per_task_to_srun(tmp_path, script, cpus, user_omp, want_flag, want_omp):
    """The scripts run as the batch step would run them, with srun and scontrol replaced by
    recorders: the srun line carries the allocation's --cpus-per-task and OpenMP follows it."""
    import subprocess
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_SRUN_OUT": str(tmp_path / "srun.txt"),
                "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
                "FPSCALE_ROOT": ROOT, "FPSCALE_PYTHON": sys.executable})
    if cpus:
        env["SLURM_CPUS_PER_TASK"] = cpus
    if user_omp:
        env["OMP_NUM_THREADS"] = user_omp
    proc = subprocess.run(["bash", f"launch/slurm/{script}", "configs/tiny_mixed.yaml"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (tmp_path / "srun.txt").read_text().splitlines()
    flags = [line[4:] for line in lines if line.startswith("arg --cpus-per-task")]
    assert flags == ([want_flag] if want_flag else []), lines
    assert f"OMP_NUM_THREADS={want_omp}" in lines


def test_srun_tasks_get_the_cpus_per_task_and_openmp_threads(cluster, tmp_path):
    """On the local cluster: pretrain.sbatch's task (a stand-in for Python that prints its view)
    sees the allocation's cpus per task and OMP_NUM_THREADS set from it (the user set none). This
    cluster's nodes have 2 CPUs and TaskPlugin=task/none (no CPU binding), so it cannot show the
    one-core binding srun >= 22.05 gives a task without --cpus-per-task; the test above checks the flag."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/bash\necho "task $SLURM_PROCID cpus_per_task=$SLURM_CPUS_PER_TASK '
                           'omp=$OMP_NUM_THREADS nproc=$(nproc)"\n')
    fake_python.chmod(0o755)
    out = tmp_path / "job.out"
    env = {"FPSCALE_PYTHON": str(fake_python), "FPSCALE_ROOT": ROOT, "OMP_NUM_THREADS": ""}
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=5",
                          f"--output={out}", "launch/slurm/pretrain.sbatch", "configs/tiny_mixed.yaml"],
                         env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=120)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    tasks = sorted(line for line in log.splitlines() if line.startswith("task "))
    assert tasks == ["task 0 cpus_per_task=2 omp=2 nproc=2", "task 1 cpus_per_task=2 omp=2 nproc=2"], log[-3000:]


def test_a_second_cluster_on_this_machine_survives_the_first_ones_teardown(cluster, tmp_path):
    """Two suites on one machine each start a LocalSlurm: each has its own munged (its own socket), so
    one fixture's teardown cannot take authentication away from the other's jobs (issue 49: the shared
    daemon, stopped by one suite, failed the other's sbatch with "Munge encode failed")."""
    with LocalSlurm(str(tmp_path / "second")) as other:
        assert other.munge_socket != cluster.munge_socket
        assert os.path.exists(other.munge_socket)
    assert not os.path.exists(other.munge_socket)             # stopped and cleaned up
    out = tmp_path / "after.out"
    job = cluster.sbatch(["--ntasks=1", "--gpus-per-node=0", f"--output={out}", "--wrap", "echo still-here"])
    info = cluster.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED" and "still-here" in out.read_text(), out.read_text()
