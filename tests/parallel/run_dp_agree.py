"""Under torchrun with N processes, each holding one sample: ``solver.agree: dp`` equals one process
that runs the N samples as one micro-batch (the quantile over the same N samples), float64: the
mean of the ranks' losses, the DP-averaged gradients and every solve's iterations (forward and
adjoint) per layer type; and the same with ``solver.chunk: 4`` (issue 39: the counts summed once per
chunk, a replay to the first stopping iteration; the chunks run eager here) against the one process's
eager loop: the same iterations, loss and gradients. Then the default per-rank stop on the same samples: the ranks run
different iterations, which ``fpscale.train.imbalance.dp_imbalance`` reports (and 0 wait with
agree: dp). Rank 0 writes OUT/report.json (per case: iterations per rank under both rules, the
bytes of the agreement per iteration) and OUT/ok.

    torchrun --nproc_per_node 16 tests/parallel/run_dp_agree.py OUT
"""
import copy
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fpscale  # noqa: E402
import fpscale.solvers.chunked as chunked  # noqa: E402
from fpscale.parallel import agree  # noqa: E402
from fpscale.parallel.state import ParallelState  # noqa: E402
from fpscale.solvers import SolverConfig  # noqa: E402
from fpscale.train.imbalance import dp_imbalance  # noqa: E402

BASE = ["model.vocab_size=32", "model.d_model=32", "model.n_heads=4", "model.max_seq_len=16", "data.seq_len=12",
        "solver.stop_quantile=0.25", "solver.tol=1e-5", "solver.max_iter=40", "solver.backward=implicit",
        "solver.backward_tol=1e-4", "solver.backward_max_iter=40", "solver.patience=3", "solver.decay=0.7",
        "model.layers.0.repeat=1"]
CASES = {
    "fpsa": ["model.layers.0.type=fpsa", "solver.forward.freeze_converged=true"],
    "fpmamba": ["model.layers.0.type=fpmamba", "model.layers.0.d_state=4"],
    "looped": ["model.layers.0.type=looped"],
    "fpmamba2": ["model.layers.0.type=fpmamba2", "model.layers.0.d_state=4", "model.layers.0.headdim=8",
                 "solver.forward.tol=1e-3"],
}
CHUNK = 4
TOL = dict(rtol=1e-9, atol=1e-12)


def iterations(model) -> dict:
    return {k: (s.iterations, s.backward_iterations) for k, s in model.solver_stats().items()}


def run_case(name, overrides, state, tokens, targets, report):
    rank, world = state.rank, state.world_size
    torch.manual_seed(0)
    cfg = fpscale.load_config(None, BASE + overrides + ["solver.forward.agree=dp"])
    whole = fpscale.build_model(cfg).double()
    with torch.no_grad():                   # a non-zero conv / y-feedback so those paths count
        for n, p in whole.named_parameters():
            if n.endswith(("conv_w", "y_proj")) and p.abs().sum() == 0:
                p.normal_(0, 0.1)
    mine = copy.deepcopy(whole)
    per_rank = copy.deepcopy(whole)
    chunks = copy.deepcopy(whole)
    for module in chunks.modules():
        if isinstance(getattr(module, "solver", None), SolverConfig):
            module.solver = dataclasses.replace(module.solver, chunk=CHUNK)
    for model in (whole, mine, per_rank, chunks):
        model.train()
    loss = whole(tokens, targets=targets)          # one process, the N samples as one micro-batch
    loss.backward()
    assert agree.attach(mine, state) == 1, name
    local = mine(tokens[rank:rank + 1], targets=targets[rank:rank + 1])
    local.backward()
    losses = torch.tensor([local.item()], dtype=torch.float64)
    dist.all_reduce(losses)
    mean = losses.item() / world
    assert abs(mean - loss.item()) <= 1e-9 * abs(loss.item()), (name, mean, loss.item())
    grads = dict(mine.named_parameters())
    for n, p in whole.named_parameters():
        g = grads[n].grad.clone()
        dist.all_reduce(g)
        assert torch.allclose(g / world, p.grad, **TOL), (name, n, (g / world - p.grad).abs().max().item())
    agreed = iterations(mine)
    assert agreed == iterations(whole), (name, agreed, iterations(whole))

    # solver.chunk: the agreement once per chunk, as the eager loop's every iteration
    assert agree.attach(chunks, state) == 1, name
    chunked.COMPILE = False
    try:
        local = chunks(tokens[rank:rank + 1], targets=targets[rank:rank + 1])
        local.backward()
    finally:
        chunked.COMPILE = True
    losses = torch.tensor([local.item()], dtype=torch.float64)
    dist.all_reduce(losses)
    assert abs(losses.item() / world - loss.item()) <= 1e-9 * abs(loss.item()), (name, "chunk", losses.item() / world)
    grads = dict(chunks.named_parameters())
    for n, p in whole.named_parameters():
        g = grads[n].grad.clone()
        dist.all_reduce(g)
        assert torch.allclose(g / world, p.grad, **TOL), (name, "chunk", n, (g / world - p.grad).abs().max().item())
    assert iterations(chunks) == agreed, (name, "chunk", iterations(chunks), agreed)

    # the default: each rank stops on its own sample
    local = per_rank(tokens[rank:rank + 1], targets=targets[rank:rank + 1])
    local.backward()
    own = iterations(per_rank)
    every = [None] * world
    dist.all_gather_object(every, own)
    (layer,) = own
    fwd = [e[layer][0] for e in every]
    rows_own = {layer: [s.to_dict() for s in per_rank.solver_stats().values()]}
    rows_agreed = {layer: [s.to_dict() for s in mine.solver_stats().values()]}
    spread, wait = dp_imbalance(rows_own, 1, state)
    assert spread[layer]["iters_dp_max"] == max(fwd) and abs(spread[layer]["iters_dp_mean"] - sum(fwd) / world) < 1e-12
    work = [e[layer][0] + (e[layer][1] or 0) for e in every]      # forward + adjoint iterations per rank
    assert abs(wait - (1 - sum(work) / world / max(work))) < 1e-12, (wait, work)
    spread_agreed, wait_agreed = dp_imbalance(rows_agreed, 1, state)
    assert wait_agreed == 0 and spread_agreed[layer]["iters_dp_max"] == spread_agreed[layer]["iters_dp_mean"]
    report[name] = {"chunked": list(iterations(chunks)[layer]),
                    "per_rank_forward": fwd, "per_rank_backward": [e[layer][1] for e in every],
                    "agreed": list(agreed[layer]), "one_process": list(iterations(whole)[layer]),
                    "dp_wait_est_per_rank_rule": wait, "agree_bytes_per_iteration": 3 * 8}


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState(rank=rank, world_size=world, local_rank=rank, tp_size=1, tp_rank=0, dp_size=world,
                          dp_rank=rank, tp_group=None, dp_group=dist.new_group(list(range(world))),
                          device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (world, 12), generator=g)
    targets = torch.randint(0, 32, (world, 12), generator=g)
    report = {}
    for name, overrides in CASES.items():
        run_case(name, overrides, state, tokens, targets, report)
    assert any(len(set(r["per_rank_forward"])) > 1 for r in report.values()), report   # imbalance, seen
    dist.barrier()
    if rank == 0:
        json.dump({"world": world, "cases": report}, open(os.path.join(out, "report.json"), "w"), indent=1)
        open(os.path.join(out, "ok"), "w").write("ok\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
