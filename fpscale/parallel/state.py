"""Process groups for tensor x data parallelism, and the ``mpu`` DeepSpeed asks for.

Ranks are laid out TP-major: the TP group of rank r is the ``tp`` consecutive ranks around it
(so TP stays inside a node), its DP group the ranks with the same TP rank.

    state = init_parallel(tp_size=2)      # reads RANK/WORLD_SIZE/LOCAL_RANK (or SLURM's variables)

Who trains (``parallel.engine``, resolved by ``resolve_engine``): DeepSpeed at any world size, one
process included (a process group of one, so that ZeRO-1/3 and DeepSpeed's optimizer path run on
one GPU as in the cluster job), or torch's AdamW in one plain process.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fpscale.errors import LayoutError, UserError


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0          # the launcher's node-local id (DeepSpeed may see another LOCAL_RANK: bind_device)
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")
    host_group: dist.ProcessGroup | None = None   # gloo over every rank, for host-side coordination (checkpoints)
    engine: str = "torch"         # "deepspeed" or "torch": who trains (resolve_engine)

    @property
    def distributed(self) -> bool:
        """Several processes: collectives are needed (DeepSpeed may also run in one: ``deepspeed``)."""
        return self.world_size > 1

    @property
    def deepspeed(self) -> bool:
        """The DeepSpeed engine trains (any world size; a process group exists, of one process too)."""
        return self.engine == "deepspeed"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self, wait_for_peers: bool = True) -> None:
        """Leave together and destroy every process group; every rank calls it at the end of a
        distributed run. A rank that exits while a peer still talks to it, or a group left to the
        interpreter's exit, can abort in gloo ("terminate called without an active exception")
        after the work is done. ``wait_for_peers=False`` skips the barrier (leaving on an error)."""
        if not ((self.distributed or self.deepspeed) and dist.is_initialized()):
            return
        if wait_for_peers:
            dist.barrier(group=self.host_group)
        dist.destroy_process_group()

    # -- the model-parallel unit deepspeed.initialize(mpu=...) expects ------------------------
    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self):
        return self.tp_size

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        return self.dp_size


def env_from_slurm() -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from SLURM when no launcher
    set them (``srun python launch/pretrain.py ...``): one task per device."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port(os.environ.get("SLURM_JOB_ID", "0"))))
    if "MASTER_ADDR" not in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        os.environ["MASTER_ADDR"] = slurm_node_address(nodes)


def slurm_master_port(job_id: str) -> int:
    """A port derived from the job id, so concurrent jobs on a node do not collide."""
    return 20000 + int(job_id) % 20000


def slurm_node_address(nodelist: str) -> str:
    """The address of the first node of a SLURM node list (its NodeAddr: a node name need not
    resolve, and gloo / NCCL would wait on it until the time limit)."""
    import subprocess
    try:
        first = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()[0]
        info = subprocess.run(["scontrol", "show", "node", first], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise UserError(f"cannot find the first node's address of SLURM node list {nodelist!r}: {exc}; "
                           "set MASTER_ADDR") from exc
    for field in info.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return first


def compute_device(local_rank: int) -> torch.device:
    """This process's GPU: ``cuda:LOCAL_RANK`` when it sees the node's GPUs (torchrun, deepspeed,
    srun with --gpus-per-node), ``cuda:0`` when the scheduler bound it to one (srun with
    --gpus-per-task=1: CUDA_VISIBLE_DEVICES names one GPU)."""
    return _device(local_rank, torch.cuda.device_count(), os.environ)


def _device(local_rank: int, visible: int, env: Mapping[str, str]) -> torch.device:
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES", "unset")
    local_procs = int(env.get("LOCAL_WORLD_SIZE", "1"))          # torchrun's processes on this node
    if visible == 1 and local_procs > 1:
        raise LayoutError(f"LOCAL_RANK {local_rank} of LOCAL_WORLD_SIZE {local_procs} processes on this node, "
                          f"but each sees the same single GPU (CUDA_VISIBLE_DEVICES={cuda_visible}): torchrun "
                          f"starts one process per GPU; give it {local_procs} GPUs or --nproc_per_node 1")
    if local_rank < visible:
        return torch.device("cuda", local_rank)
    if visible == 1:
        return torch.device("cuda", 0)
    raise LayoutError(f"LOCAL_RANK {local_rank} but this process sees {visible} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={cuda_visible}): start one "
                      f"process per GPU, each seeing all of its node's GPUs or exactly one")


def bind_device(env: Mapping[str, str], visible: int) -> tuple[torch.device, dict[str, str]]:
    """(this process's device, the variables to set so that DeepSpeed binds the same one) for the
    launcher environment ``env`` (after env_from_slurm) of a process that sees ``visible`` GPUs.

    torchrun, ``deepspeed`` and srun with the node's GPUs visible: ``cuda:LOCAL_RANK``, nothing to
    set. srun --gpus-per-task=1 (one GPU visible): ``cuda:0``, and LOCAL_RANK becomes "0" where it
    was the task's node-local id. DeepSpeed 0.19.8 takes its device from that variable:
    runtime/engine.py ``_configure_with_arguments`` sets ``self.local_rank = int(os.environ['LOCAL_RANK'])``
    (asserting OMPI_COMM_WORLD_LOCAL_RANK equal where set) and ``_set_distributed_vars`` calls
    ``get_accelerator().set_device(self.local_rank)`` ("invalid device ordinal" for every task of a
    node but the first); ZeRO-3 (zero/partition_parameters.py, zero/utils.py) reads it too. The
    launcher's node-local id stays in FPSCALE_LOCAL_RANK and ParallelState.local_rank. fpscale hands
    deepspeed.initialize no ``args``, so the ``--local_rank`` the deepspeed launcher passes (equal to
    its LOCAL_RANK) is never compared with the rewritten variable. No GPU: the CPU, nothing to set."""
    if visible == 0:
        return torch.device("cpu"), {}
    local_rank = int(env.get("LOCAL_RANK", "0"))
    device = _device(local_rank, visible, env)
    if device.index == local_rank:
        return device, {}
    updates = {"LOCAL_RANK": str(device.index), "FPSCALE_LOCAL_RANK": str(local_rank)}
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        updates["OMPI_COMM_WORLD_LOCAL_RANK"] = str(device.index)
    return device, updates


_rebound: dict[str, str] = {}      # LOCAL_RANK as bind_device rewrote it in this process -> as the launcher set it


DEEPSPEED_LAUNCHER_ENV = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def launched_by_deepspeed(env: Mapping[str, str]) -> bool:
    """Whether the ``deepspeed`` launcher started this process: DeepSpeed 0.19.8's launcher/launch.py
    sets CROSS_RANK, CROSS_SIZE (deepspeed/constants.py) and LOCAL_SIZE in every process it spawns,
    whatever the world size; torchrun, srun and a plain ``python`` set none of them (torchrun's are
    LOCAL_WORLD_SIZE / GROUP_RANK). The ``--local_rank`` argument is no sign: ``--no_local_rank``
    drops it."""
    return all(name in env for name in DEEPSPEED_LAUNCHER_ENV)


def resolve_engine(engine: str, world: int, env: Mapping[str, str]) -> tuple[str, str]:
    """(``deepspeed`` or ``torch``, why) for ``parallel.engine`` in a job of ``world`` processes.
    ``auto`` (config.py turns it into ``deepspeed`` where parallel.zero_stage was set): DeepSpeed for
    several processes or under the ``deepspeed`` launcher, torch's AdamW in a plain single process."""
    if engine == "torch":
        if world > 1:
            raise LayoutError(f"parallel.engine = torch trains one process, but WORLD_SIZE is {world}: "
                              "several processes train through DeepSpeed (parallel.engine: deepspeed or auto)")
        return "torch", "parallel.engine: torch"
    if engine == "deepspeed":
        return "deepspeed", "parallel.engine: deepspeed"
    if world > 1:
        return "deepspeed", f"auto: {world} processes"
    if launched_by_deepspeed(env):
        return "deepspeed", "auto: started by the deepspeed launcher"
    return "torch", "auto: one process, not started by the deepspeed launcher"


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(tp_size: int = 1, timeout_s: float = 300.0, engine: str = "auto") -> ParallelState:
    """Initialise torch.distributed (gloo on CPU, NCCL on GPU) and the TP x DP groups.

    Without launcher variables this is a single process and nothing is initialised, unless
    ``engine`` (``parallel.engine``) resolves to DeepSpeed: then a process group of one (on a
    free local port where no launcher set MASTER_ADDR / MASTER_PORT).
    ``timeout_s`` bounds every collective: a peer that died makes the others fail, not hang.
    """
    env_from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if tp_size < 1 or world % tp_size:
        raise LayoutError(f"world size {world} is not divisible by parallel.tp = {tp_size}")
    engine, _ = resolve_engine(engine, world, os.environ)
    cuda = torch.cuda.is_available()
    launcher = dict(os.environ)
    if launcher.get("LOCAL_RANK") in _rebound:         # an earlier call in this process rewrote it
        launcher["LOCAL_RANK"] = _rebound[launcher["LOCAL_RANK"]]
    local_rank = int(launcher.get("LOCAL_RANK", "0"))
    # the one place the device is chosen; DeepSpeed is told through os.environ (see bind_device)
    device, deepspeed_env = bind_device(launcher, torch.cuda.device_count() if cuda else 0)
    os.environ.update(deepspeed_env)
    if deepspeed_env:
        _rebound[deepspeed_env["LOCAL_RANK"]] = str(local_rank)
    if world == 1 and tp_size == 1 and engine == "torch":
        return ParallelState(device=device)
    if world == 1 and not dist.is_initialized():        # DeepSpeed in one process: a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(name, value)          # DeepSpeed reads them (runtime/engine.py)
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    tp_rank, dp_rank, dp_size = rank % tp_size, rank // tp_size, world // tp_size
    tp_group = dp_group = None
    for k in range(dp_size):                         # every rank must create every group
        g = dist.new_group(list(range(k * tp_size, (k + 1) * tp_size)))
        if k == dp_rank:
            tp_group = g
    for t in range(tp_size):
        g = dist.new_group(list(range(t, world, tp_size)))
        if t == tp_rank:
            dp_group = g
    return ParallelState(rank, world, local_rank, tp_size, tp_rank, dp_size, dp_rank, tp_group, dp_group, device,
                         new_host_group(timeout_s), engine)


def new_host_group(timeout_s: float):
    """A gloo group over every rank for what is truly host-side (object collectives and barriers
    of checkpoints), beside the compute group (NCCL on GPUs), with its own timeout. Every rank
    must call it, in the same order."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
