"""One rank of a GPU job, simulated on this GPU-less machine, that records which device fpscale chose
and which device DeepSpeed was told to use (used by tests/parallel/test_device_binding.py).

    SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_NTASKS=2 CUDA_VISIBLE_DEVICES=1 ... \\
        python tests/parallel/run_device_binding.py OUT_DIR          # as srun --gpus-per-task=1 starts it

The process "sees" as many GPUs as CUDA_VISIBLE_DEVICES names: ``torch.cuda.is_available`` and
``device_count`` say so while ``init_parallel`` binds the device (``torch.cuda.set_device`` is recorded,
the process group is gloo where fpscale asks for NCCL). Then the CPU takes over: a Trainer is built on
that state with its device set to the CPU, and right before ``deepspeed.initialize`` the environment
DeepSpeed reads is recorded, as is every argument of the accelerator's ``set_device`` (a no-op on
DeepSpeed's CPU accelerator, ``torch.cuda.set_device(LOCAL_RANK)`` on a GPU). Writes rank{RANK}.json.
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fpscale  # noqa: E402

TINY = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32",
        "model.max_seq_len=32", "train.micro_batch=2", "train.global_batch=4", "train.steps=1",
        "train.resume=none", "solver.forward.stop_quantile=0.0"]


def bind_as_scheduled() -> tuple:
    """init_parallel in a process that sees CUDA_VISIBLE_DEVICES' GPUs; returns (state, torch.cuda.set_device calls)."""
    from fpscale.parallel.state import init_parallel
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    calls = []
    saved = torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device, dist.init_process_group
    torch.cuda.is_available = lambda: bool(visible)
    torch.cuda.device_count = lambda: len(visible)
    torch.cuda.set_device = lambda device: calls.append(str(device))
    dist.init_process_group = lambda backend, **kw: saved[3]("gloo", **kw)      # no NCCL without a GPU
    try:
        state = init_parallel(timeout_s=60)
    finally:
        torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device, dist.init_process_group = saved
    return state, calls


def main():
    out = sys.argv[1]
    state, torch_calls = bind_as_scheduled()
    chosen = state.device
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    seen = {"set_device": [], "env": None}
    set_device, initialize = accelerator.set_device, deepspeed.initialize

    def recording_set_device(index):
        seen["set_device"].append(int(index))
        return set_device(index)

    def recording_initialize(*args, **kwargs):
        seen["env"] = {k: os.environ.get(k) for k in ("LOCAL_RANK", "FPSCALE_LOCAL_RANK", "RANK", "WORLD_SIZE")}
        return initialize(*args, **kwargs)

    accelerator.set_device, deepspeed.initialize = recording_set_device, recording_initialize
    from fpscale.train.trainer import Trainer
    cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_attn.yaml"),
                              TINY + [f"train.out_dir={out}"])
    on_cpu = dataclasses.replace(state, device=torch.device("cpu"))
    trainer = Trainer(cfg, log=False, state=on_cpu)
    report = {"rank": state.rank, "device": str(chosen), "local_rank": state.local_rank,
              "torch_set_device": torch_calls, "env_at_initialize": seen["env"],
              "deepspeed_set_device": seen["set_device"], "engine_local_rank": trainer.engine.local_rank}
    with open(os.path.join(out, f"rank{state.rank}.json"), "w") as fh:
        json.dump(report, fh)
    trainer.close()
    on_cpu.close()


if __name__ == "__main__":
    main()
