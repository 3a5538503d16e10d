"""The device each rank takes under every launcher, and the one DeepSpeed is told to take.

fpscale binds ``cuda:LOCAL_RANK`` when a process sees its node's GPUs and ``cuda:0`` when the
scheduler bound it to one; DeepSpeed 0.19.8 calls ``set_device(int(os.environ["LOCAL_RANK"]))`` in
``deepspeed.initialize``, so under srun --gpus-per-task=1 LOCAL_RANK must name device 0 too
(``fpscale.parallel.state.bind_device``). No GPU here: the binding is simulated (run_device_binding.py).
"""
import os
import shlex
import sys

import pytest
import torch

from fpscale.errors import LayoutError
from fpscale.parallel.state import bind_device, env_from_slurm
from tests.parallel.launch import free_port, read_ranks, run

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
DEEPSPEED = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
             "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def slurm_env(monkeypatch, localid: int, visible: str) -> dict:
    """The variables env_from_slurm leaves for task 3 (node-local id ``localid``) of a 4-task job."""
    for name in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "FPSCALE_LOCAL_RANK"} | {n for n in os.environ if n.startswith(("SLURM_", "OMPI_"))}:
        monkeypatch.setenv(name, "")       # recorded: what env_from_slurm / init_parallel set is undone after
        monkeypatch.delenv(name)
    for name, value in {"SLURM_PROCID": "3", "SLURM_LOCALID": str(localid), "SLURM_NTASKS": "4",
                        "SLURM_JOB_ID": "7", "MASTER_ADDR": "10.0.0.1", "CUDA_VISIBLE_DEVICES": visible}.items():
        monkeypatch.setenv(name, value)
    env_from_slurm()
    return dict(os.environ)


@pytest.mark.parametrize("launcher,env,visible,device", [
    ("torchrun", TORCHRUN, 2, "cuda:1"),
    ("torchrun on 8 GPUs", TORCHRUN, 8, "cuda:1"),
    ("deepspeed", DEEPSPEED, 2, "cuda:1"),                 # CUDA_VISIBLE_DEVICES lists the node's GPUs
    ("deepspeed --include localhost:2,3", {**DEEPSPEED, "CUDA_VISIBLE_DEVICES": "2,3"}, 2, "cuda:1"),
])
def test_launchers_that_show_the_node_gpus_bind_cuda_local_rank_and_leave_deepspeed_alone(launcher, env,
                                                                                           visible, device):
    got, updates = bind_device(env, visible)
    assert str(got) == device and updates == {}, launcher


def test_srun_with_the_node_gpus_visible_binds_cuda_localid(monkeypatch):
    env = slurm_env(monkeypatch, localid=1, visible="0,1,2,3")
    assert env["LOCAL_RANK"] == "1" and env["RANK"] == "3"
    got, updates = bind_device(env, 4)
    assert str(got) == "cuda:1" and updates == {}


def test_srun_one_gpu_per_task_binds_cuda_0_and_tells_deepspeed_so(monkeypatch):
    env = slurm_env(monkeypatch, localid=1, visible="1")
    got, updates = bind_device(env, 1)
    assert str(got) == "cuda:0"
    assert updates == {"LOCAL_RANK": "0", "FPSCALE_LOCAL_RANK": "1"}     # the task's node-local id is kept
    assert bind_device({**env, **updates}, 1) == (got, {})               # the rewritten env binds the same


def test_an_mpi_local_rank_is_rewritten_with_local_rank():
    """DeepSpeed asserts LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK where the latter is set."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    _, updates = bind_device(env, 1)
    assert updates["LOCAL_RANK"] == updates["OMPI_COMM_WORLD_LOCAL_RANK"] == "0"


def test_no_gpu_is_the_cpu_and_changes_nothing():
    assert bind_device(TORCHRUN, 0) == (torch.device("cpu"), {})


@pytest.mark.parametrize("env,visible,message", [
    ({**TORCHRUN, "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, 2,
     r"LOCAL_RANK 3 but this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"),
    # torchrun --nproc_per_node 2 with one GPU visible: both processes would take cuda:0
    ({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "0"}, 1,
     r"LOCAL_RANK 1 of LOCAL_WORLD_SIZE 2 processes on this node, but each sees the same single GPU "
     r"\(CUDA_VISIBLE_DEVICES=0\)"),
])
def test_a_process_without_a_gpu_of_its_own_is_a_layout_error(env, visible, message):
    with pytest.raises(LayoutError, match=message):
        bind_device(env, visible)


def test_init_parallel_tells_deepspeed_and_keeps_the_node_local_id_across_calls(monkeypatch):
    """init_parallel applies bind_device to os.environ; a second call in the same process (several
    Trainers in one process) binds the same device and still knows the task's node-local id."""
    import torch.distributed as dist

    from fpscale.parallel import state as state_module
    slurm_env(monkeypatch, localid=1, visible="1")
    monkeypatch.setattr(state_module, "_rebound", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)            # no process group: groups are stubs
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: None)
    for _ in range(2):
        state = state_module.init_parallel()
        assert (str(state.device), state.local_rank, state.rank, state.world_size) == ("cuda:0", 1, 3, 4)
        assert os.environ["LOCAL_RANK"] == "0" and os.environ["FPSCALE_LOCAL_RANK"] == "1"


# -- two ranks started as srun starts them, each bound as the scheduler would bind it ----------------

def srun_like(tmp_path, tasks: list[dict], timeout: float = 240, check: bool = True):
    """Start tests/parallel/run_device_binding.py once per task, each with its own SLURM variables
    (no launcher variables: env_from_slurm maps them), in one process group that run() kills on timeout."""
    port = free_port()
    lines = []
    for i, extra in enumerate(tasks):
        env = {"SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NTASKS": str(len(tasks)),
               "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}
        assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE {assign} "
                     f"{shlex.quote(sys.executable)} tests/parallel/run_device_binding.py {shlex.quote(str(tmp_path))} "
                     f"& p{i}=$!")
    waits = "; ".join(f"wait $p{i} || rc=1" for i in range(len(tasks)))
    return run(["bash", "-c", "\n".join(lines) + f"\nrc=0; {waits}; exit $rc"], timeout=timeout, check=check)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_srun_with_the_node_gpus_visible_deepspeed_binds_cuda_local_rank(tmp_path):
    srun_like(tmp_path, [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "0,1"}])
    ranks = read_ranks(str(tmp_path))
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        k = r["rank"]
        assert r["device"] == f"cuda:{k}" and r["torch_set_device"] == [f"cuda:{k}"] and r["local_rank"] == k
        assert r["env_at_initialize"]["LOCAL_RANK"] == str(k) and r["env_at_initialize"]["FPSCALE_LOCAL_RANK"] is None
        assert r["deepspeed_set_device"] == [k] and r["engine_local_rank"] == k


@pytest.mark.slow
@pytest.mark.multiprocess
def test_srun_one_gpu_per_task_deepspeed_binds_the_one_gpu_each_task_sees(tmp_path):
    """srun --gpus-per-task=1: task 1 sees one GPU (CUDA_VISIBLE_DEVICES=1) as cuda:0. Before the fix
    DeepSpeed was handed LOCAL_RANK 1 there: set_device(1), "invalid device ordinal" on a GPU."""
    srun_like(tmp_path, [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}])
    ranks = read_ranks(str(tmp_path))
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["device"] == "cuda:0" and r["torch_set_device"] == ["cuda:0"]
        assert r["local_rank"] == r["rank"]                                  # the node-local id, kept
        assert r["env_at_initialize"]["LOCAL_RANK"] == "0"
        assert r["deepspeed_set_device"] == [0] and r["engine_local_rank"] == 0, r
    assert ranks[1]["env_at_initialize"]["FPSCALE_LOCAL_RANK"] == "1"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_srun_tasks_beyond_the_visible_gpus_fail_naming_the_mismatch(tmp_path):
    """Tasks 2 and 3 of a node that shows them 2 GPUs (--ntasks-per-node=4 --gpus-per-node=2)."""
    proc = srun_like(tmp_path, [{"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "0,1"},
                                {"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1"}], timeout=120, check=False)
    assert proc.returncode != 0
    for k in (2, 3):
        assert (f"LayoutError: LOCAL_RANK {k} but this process sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1)"
                in proc.stdout), proc.stdout[-3000:]
    assert not [f for f in os.listdir(tmp_path) if f.startswith("rank")]

