"""Several pretraining runs, one after the other, in ONE launch: one process group, one import of
torch and DeepSpeed for all of them (a launch per run spent most of its time starting). Each run is
what ``launch/pretrain.py --config CONFIG OVERRIDES name=NAME parallel.zero_stage=ZERO`` does
(fpscale/cli/pretrain.py: load the config, build the Trainer, train, close), on the launch's ranks;
only the process group is shared: the first Trainer initialises it, the later ones find it
(fpscale.parallel.state.init_parallel), and only the last one destroys it.
Used by tests/parallel/test_bf16_accumulation.py.

    torchrun --nproc_per_node 2 tests/parallel/run_pretrain_runs.py CONFIG NAME:ZERO[,NAME:ZERO ...] [key=value ...]

Rank 0 prints ``=== run NAME ===`` before each run and ``=== end NAME ===`` after it, so that a
test can read each run's log lines (``resumed from ...``) apart.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fpscale.config import load_config  # noqa: E402
from fpscale.train.trainer import Trainer  # noqa: E402


def main():
    config, runs, overrides = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    main_rank = os.environ.get("RANK", "0") == "0"
    for i, run in enumerate(runs):
        name, zero = run.split(":")
        if main_rank:
            print(f"=== run {name} ===", flush=True)
        cfg = load_config(config, [*overrides, f"name={name}", f"parallel.zero_stage={zero}"])
        trainer = Trainer(cfg)             # the first one initialises the process group, the others reuse it
        trainer.owns_state = i == len(runs) - 1          # the last one leaves it (together, then destroyed)
        with trainer:
            trainer.train()
        if main_rank:
            print(f"=== end {name} ===", flush=True)


if __name__ == "__main__":
    main()
