"""train.optimizer: muon_adamw on several layouts in one launch (used by tests/parallel/test_muon_layouts.py).

    python tests/parallel/run_muon.py OUT ref                       # one process, the reference
    torchrun --nproc_per_node 4 tests/parallel/run_muon.py OUT grid   # TP2 x DP2 ZeRO-1
    torchrun --nproc_per_node 2 tests/parallel/run_muon.py OUT pairs  # TP2, DP2 ZeRO-1/2/3 (+ bf16 0-2), resumes
    python tests/parallel/run_muon.py OUT modes_ref                 # Attractor's and Keller's modes, one process
    torchrun --nproc_per_node 2 tests/parallel/run_muon.py OUT modes  # the same on TP2, DP2 ZeRO-1 and ZeRO-3

Every run trains 5 steps and saves at step 3 and 5 (OUT/<run>/checkpoints); ``pairs`` also resumes
TP2 and DP2 ZeRO-1 from their step-3 checkpoints (``<run>_resumed``) and DP2 ZeRO-1 from the grid's
step-3 checkpoint through the universal checkpoint (``grid_to_dp2``). Rank 0 writes OUT/<mode>.json:
the losses of every run.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fpscale  # noqa: E402
from fpscale.parallel.state import init_parallel  # noqa: E402
from fpscale.train.trainer import Trainer  # noqa: E402
from tests.parallel.launch import pinned  # noqa: E402

BASE = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32", "model.n_heads=4",
        "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=8", "train.steps=5", "train.warmup=2",
        "train.log_interval=1000", "train.eval_interval=1000", "solver.forward.stop_quantile=0.0", "train.resume=none",
        "train.save_interval=3", "train.save_interval_minutes=0", "train.keep_last=0",
        "model.layers=[{type: attn}, {type: looped, core_blocks: 1, solver: {backward: phantom, phantom_steps: 2}}]",
        "solver.forward.max_iter=6", "solver.forward.tol=1e-3",
        "train.optimizer=muon_adamw", "train.muon.ns_dtype=fp32", "train.muon.weight_decay=0.5",
        "train.muon.momentum_warmup=3", "train.lr_scale.embed=2.0", "train.group_weight_decay.scalar=0.0"]
BASE += pinned(None, BASE, iters=6)     # the looped core at a fixed depth: no tolerance stop to flip across layouts
# Muon as Attractor's MuonAdamW (NorMuon, decay x shape scale to 0, polar express) and as Keller's Muon
MODES = {"attractor": ["train.muon.shape_scale=keller", "train.muon.normuon=true", "train.muon.wd_scale=step",
                       "train.muon.wd_schedule=linear", "train.muon.ns_coefficients=polar_express"],
         "keller": ["train.muon.shape_scale=keller", "train.muon.cautious_wd=false", "train.muon.split_fused=false"]}
# ZeRO-3 partitions a parameter only above stage3_param_persistence_threshold elements (1e5 by default)
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def train(out: str, name: str, extra: list[str], state=None, overrides=None) -> list[float]:
    cfg = fpscale.load_config(None, BASE + [f"train.out_dir={out}", f"name={name}", *extra])
    if state is not None and state.tp_size == 1:
        # DeepSpeed keeps the last engine's mpu in a global (deepspeed/utils/groups.py ``mpu``): a TP
        # engine earlier in this process would make a DP-only one read the TP group's size
        from deepspeed.utils import groups
        groups.mpu = None
    trainer = Trainer(cfg, log=False, state=state, deepspeed_overrides=overrides)
    losses = []
    while trainer.step < cfg.train.steps:
        losses.append(trainer.train_step()["loss"])
        if trainer.step == 3:
            trainer.save_checkpoint()
    trainer.save_checkpoint()
    whole = whole_params(trainer)
    if trainer.state.rank == 0:
        torch.save(whole, os.path.join(out, f"{name}.pt"))
    trainer.close()
    return losses


def whole_params(trainer) -> dict:
    """{name: whole fp32 tensor} of the trained model on any layout: ZeRO-3 partitions gathered
    over DP, TP slices gathered over TP (``unshard``)."""
    import deepspeed
    import torch.distributed as dist

    from fpscale.parallel.layers import unshard
    model, state = trainer.model, trainer.state
    params = dict(model.named_parameters())
    out = {}
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=trainer.cfg.parallel.zero_stage == 3):
        for name, p in params.items():
            t = p.detach().float().clone()
            if getattr(p, "tensor_model_parallel", False) and state.tp_size > 1:
                pieces = [torch.empty_like(t) for _ in range(state.tp_size)]
                dist.all_gather(pieces, t, group=state.tp_group)
                t = unshard(pieces, p.partition_dim, getattr(p, "tp_parts", 1))
            out[name] = t
    return out


def step3(out: str, name: str) -> str:
    return os.path.join(out, name, "checkpoints", "step_00000003")


def main():
    out, mode = sys.argv[1], sys.argv[2]
    runs = {}
    if mode == "ref":
        runs["ref"] = train(out, "ref", [])
    elif mode == "grid":
        state = init_parallel(2)
        runs["grid"] = train(out, "grid", ["parallel.tp=2", "parallel.zero_stage=1"], state)
        state.close()
    elif mode == "modes_ref":
        for m, extra in MODES.items():
            runs[m] = train(out, m, extra)
    elif mode == "modes":
        tp2, dp2 = init_parallel(2), init_parallel(1)
        for m, extra in MODES.items():
            runs[f"{m}_tp2"] = train(out, f"{m}_tp2", [*extra, "parallel.tp=2", "parallel.zero_stage=1"], tp2)
            runs[f"{m}_dp2_zero1"] = train(out, f"{m}_dp2_zero1", [*extra, "parallel.zero_stage=1"], dp2)
        extra = MODES["attractor"]         # NorMuon's moments in ZeRO-3's per-parameter partitions, and resumed
        runs["attractor_dp2_zero3"] = train(out, "attractor_dp2_zero3", [*extra, "parallel.zero_stage=3"], dp2, ZERO3)
        runs["attractor_dp2_zero1_resumed"] = train(out, "attractor_dp2_zero1_resumed", [
            *extra, "parallel.zero_stage=1", f"train.resume={step3(out, 'attractor_dp2_zero1')}"], dp2)
        try:                               # NorMuon's moments do not travel through a universal checkpoint
            train(out, "attractor_tp2_to_dp2", [*extra, "parallel.zero_stage=1",
                                                f"train.resume={step3(out, 'attractor_tp2')}"], dp2)
            runs["attractor_tp2_to_dp2_refused"] = ""
        except Exception as e:             # noqa: BLE001 - the refusal's message is what the test reads
            runs["attractor_tp2_to_dp2_refused"] = str(e)
        dp2.close()
    else:
        tp2, dp2 = init_parallel(2), init_parallel(1)
        runs["tp2"] = train(out, "tp2", ["parallel.tp=2", "parallel.zero_stage=1"], tp2)
        runs["tp2_resumed"] = train(out, "tp2_resumed", ["parallel.tp=2", "parallel.zero_stage=1",
                                                         f"train.resume={step3(out, 'tp2')}"], tp2)
        for zero in (1, 2, 3):
            runs[f"dp2_zero{zero}"] = train(out, f"dp2_zero{zero}", [f"parallel.zero_stage={zero}"], dp2,
                                            ZERO3 if zero == 3 else None)
        for zero in (0, 1, 2):            # bf16: ZeRO-0/1 step through DeepSpeed's BF16_Optimizer, ZeRO-2 its own
            runs[f"dp2_zero{zero}_bf16"] = train(out, f"dp2_zero{zero}_bf16", [f"parallel.zero_stage={zero}",
                                                                            "train.precision=bf16"], dp2)
        runs["dp2_zero1_resumed"] = train(out, "dp2_zero1_resumed", ["parallel.zero_stage=1",
                                                                     f"train.resume={step3(out, 'dp2_zero1')}"], dp2)
        grid = os.path.join(os.path.dirname(out.rstrip("/")), "grid")
        if os.path.isdir(grid):
            runs["grid_to_dp2"] = train(out, "grid_to_dp2", ["parallel.zero_stage=1",
                                                             f"train.resume={step3(grid, 'grid')}"], dp2)
        dp2.close()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as fh:
            json.dump(runs, fh)


if __name__ == "__main__":
    main()
