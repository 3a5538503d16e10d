"""Train a few steps on one layout and write what each rank saw (used by the layout tests).

    torchrun --nproc_per_node 2 tests/parallel/run_layout.py OUT_DIR zero_stage=3 [key=value ...]
    python tests/parallel/run_layout.py OUT_DIR                         # the one-process reference
    torchrun --nproc_per_node 2 tests/parallel/run_layout.py OUT_A zero_stage=1 --then OUT_B nan_at=2 ...
The second form runs several cases one after the other in one launch (one process group, one import
of torch and DeepSpeed for all: a launch per case spent most of its time starting); each case builds
its own Trainer (seeded by its config as in a launch of its own), writes into its own OUT_DIR and
counts its own collectives. launch.layout_cases starts it.
Extra ``rank_tol=a,b`` gives each rank its own solver tolerance (deliberately uneven convergence);
``nan_at=S`` makes the last rank's embeddings NaN in step S (one rank's non-finite loss);
``plugin=module`` imports a module first (one that registers a layer type of its own).
``pinned=N`` solves every looped layer to a fixed depth of N iterations (launch.pinned: tol 0, patience 0;
forward, evaluation and adjoint), so that no tolerance decision can flip between layouts; with ``ds=1`` the
deep-supervision model is pinned too, at its own caps (its randomised caps still vary the depth).
``ds=1`` also trains ``DS``, a looped core with deep supervision (windows of 2), 5 steps on one micro-batch
per DP rank of the global 8 with ``solver.agree: dp`` (so DP ranks = one process with all 8), in the same
processes after the main run (no launch of its own), and writes it as ``deep_supervision``.
Every step and the validation run under ``device_check.checked_collectives``: a collective handed a
tensor off the compute device fails the run (what NCCL would do on a GPU).
"""
import importlib
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fpscale  # noqa: E402
from fpscale.train.trainer import Trainer  # noqa: E402
from tests.parallel.device_check import checked_collectives, unnamed_device_is_meta  # noqa: E402
from tests.parallel.launch import pinned  # noqa: E402

BASE = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32",
        "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=8", "train.steps=5", "train.warmup=2",
        "train.log_interval=1000", "train.eval_interval=1000", "solver.forward.stop_quantile=0.0", "train.resume=none"]


DS = ["model.layers=[{type: attn}, {type: looped, core_blocks: 1, conv: true, deep_supervision: {window: 2}, "
      "solver: {backward: phantom, phantom_steps: 2, tol: 1e-3, max_iter: 12, agree: dp}}, {type: attn}]",
      "model.iteration_cap.dist=exponential", "model.iteration_cap.mean=7"]


def deep_supervised(trainer, out: str, layout: list[str], pin: bool = False) -> list[dict]:
    """5 steps of DS on ``trainer``'s process groups: loss, gradient norm, iterations and windows
    (``pin``: every solve runs to its randomised cap)."""
    dp = trainer.state.dp_size
    overrides = BASE + [f"train.out_dir={out}/ds", "name=ds", f"train.micro_batch={8 // dp}", *DS, *layout]
    if pin:
        overrides += pinned("configs/tiny_attn.yaml", overrides, iters=None)
    cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_attn.yaml"),
                              overrides)
    ds = Trainer(cfg, log=False, state=trainer.state)
    steps = []
    for _ in range(cfg.train.steps):
        s = ds.train_step()
        stats = s["layer_stats"]["layers.1.looped"]
        steps.append({"loss": s["loss"], "grad_norm": s["grad_norm"], "iterations": [st.iterations for st in stats],
                      "windows": [st.windows for st in stats]})
    ds.close()
    return steps


def main():
    import torch
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    cases, case = [], []
    for arg in sys.argv[1:]:
        if arg == "--then":
            cases.append(case)
            case = []
        else:
            case.append(arg)
    cases.append(case)
    with checked_collectives(device) as checked:       # before DeepSpeed looks the collectives up
        for i, (out, *args) in enumerate(cases):
            before = Counter(checked)
            run(checked, out, args, last=i == len(cases) - 1, before=before)


def run(checked, out: str, args: list[str], last: bool = True, before: Counter | None = None):
    """One case: train as ``args`` say and write OUT/rank{RANK}.json (its collectives: those since
    ``before``). Every case but the last leaves the process group to the next one (the last one
    destroys it, on every rank together)."""
    zero = [a.split("=")[1] for a in args if a.startswith("zero_stage=")]
    rank_tol = [a.split("=")[1] for a in args if a.startswith("rank_tol=")]
    nan_at = [int(a.split("=")[1]) for a in args if a.startswith("nan_at=")]
    config = ([a.split("=")[1] for a in args if a.startswith("config=")] or ["tiny_mixed.yaml"])[0]
    for plugin in [a.split("=")[1] for a in args if a.startswith("plugin=")]:
        importlib.import_module(plugin)
    pin = [int(a.split("=")[1]) for a in args if a.startswith("pinned=")]
    own = ("zero_stage=", "rank_tol=", "config=", "nan_at=", "plugin=", "ds=", "pinned=")
    with_ds = "ds=1" in args
    overrides = BASE + [f"train.out_dir={out}"] + [a for a in args if not a.startswith(own)]
    if zero:
        overrides.append(f"parallel.zero_stage={zero[0]}")
    rank = int(os.environ.get("RANK", "0"))
    if rank_tol:
        tol = rank_tol[0].split(",")[rank]
        overrides += [f"model.layers.{i}.solver.forward.tol={tol}" for i in (1, 2, 3)]
    if pin:
        overrides += pinned(f"configs/{config}", overrides, pin[0])
    cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", config), overrides)
    trainer = Trainer(cfg, log=False)
    trainer.owns_state = last               # the first case initialised the process group, the later ones reuse it
    if nan_at and rank == trainer.state.world_size - 1:
        trainer.model.embed.register_forward_hook(
            lambda m, i, out: out * float("nan") if trainer.step == nan_at[0] else out)
    steps = []
    with unnamed_device_is_meta():
        for _ in range(cfg.train.steps):
            s = trainer.train_step()
            steps.append({"loss": s["loss"], "grad_norm": s["grad_norm"], "skipped": s["skipped"],
                          "iterations": {k: [st.iterations for st in v] for k, v in s["layer_stats"].items()},
                          "backward_iterations": {k: [getattr(st, "backward_iterations", None) for st in v]
                                                  for k, v in s["layer_stats"].items()}})
        val = trainer.evaluate()
    layout = [a for a in overrides if a.startswith("parallel.")]
    ds_steps = deep_supervised(trainer, out, layout, pin=bool(pin)) if with_ds else None
    # replicated (not TP-split) weights: every TP shard must hold the very same values
    replicated = {n: float(p.detach().double().sum()) for n, p in trainer.model.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False) and p.numel() > 0}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"steps": steps, "val_loss": val["val_loss"], "world": trainer.state.world_size,
                   "replicated": replicated, "checked_collectives": dict(checked - (before or Counter())),
                   **({"deep_supervision": ds_steps} if with_ds else {})}, fh)
    trainer.close()
    if not last and trainer.state.deepspeed:
        # DeepSpeed keeps the last engine's mpu (our TP state) as a module global and reads it in the next
        # engine even when that one is given none: a TP-less case after a TP2 one would find TP 2 and fail
        # (engine.py: mpu.get_model_parallel_rank on None). Leave its group references as a fresh process has
        # them (what it does itself when the world group is destroyed; DeepSpeed 0.19.8).
        from deepspeed.utils import groups
        groups._release_process_group_references()


if __name__ == "__main__":
    main()
