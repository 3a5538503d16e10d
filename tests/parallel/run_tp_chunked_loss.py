"""Under torchrun with 2 processes: the chunked cross-entropy over a vocabulary split over TP.

Each rank builds the same dense tensors and models (same seed). Checked, float64: the TP chunked
loss (VocabParallelLMHead.chunked_loss) and its gradients (hidden states, this rank's weight
rows) against the dense F.cross_entropy of one process; a whole tiny model split over TP with
``model.loss_chunk`` 5 against the unsplit model with the plain head (``loss_chunk`` 0), tied and
untied output layers; and under bf16 autocast the TP chunked head against the TP plain head.
Rank 0 writes OUT/ok on success.

    torchrun --nproc_per_node 2 tests/parallel/run_tp_chunked_loss.py OUT
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fpscale  # noqa: E402
from fpscale.parallel.layers import VocabParallelLMHead, shard, unshard  # noqa: E402
from fpscale.parallel.parallelize import parallelize  # noqa: E402
from fpscale.parallel.state import ParallelState  # noqa: E402

TOL = dict(rtol=1e-11, atol=1e-13)


def head_case(rank, world, group):
    g = torch.Generator().manual_seed(0)
    N, d, V = 23, 8, 10
    h = torch.randn(N, d, generator=g, dtype=torch.float64)
    w = torch.randn(V, d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[2, 3, 17]] = -100
    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(hd, wd), targets, ignore_index=-100)
    (3 * ref).backward()
    head = VocabParallelLMHead(group)
    for chunk in (4, 7, 23, 100):          # 4, 7 do not divide N = 23
        hs, ws = h.clone().requires_grad_(), shard(w, 0, rank, world).requires_grad_()
        loss = head.chunked_loss(hs, ws, targets, chunk)
        (3 * loss).backward()
        assert torch.allclose(loss, ref, **TOL), (chunk, float(loss), float(ref))
        assert torch.allclose(hs.grad, hd.grad, **TOL), (chunk, (hs.grad - hd.grad).abs().max())
        assert torch.allclose(ws.grad, shard(wd.grad, 0, rank, world), **TOL), chunk

    # bf16 autocast: the TP chunked head against the TP plain head (forward, then loss)
    h32, w32 = h.float(), shard(w, 0, rank, world).float()
    got, want = [], []
    for fn, out in ((lambda a, b: head.chunked_loss(a, b, targets, 5), got),
                    (lambda a, b: head.loss(head(a[None], b), targets[None]), want)):
        a, b = h32.clone().requires_grad_(), w32.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(a, b)
        loss.backward()
        out += [loss.detach(), a.grad, b.grad]
    assert got[0].dtype == torch.float32 and torch.allclose(got[0], want[0], rtol=1e-5), (got[0], want[0])
    for x, y in zip(got[1:], want[1:]):
        assert x.dtype == torch.float32
        assert torch.allclose(x, y, rtol=2e-2, atol=2e-2 * y.abs().max().item()), (x - y).abs().max()


def model_case(state, tied):
    torch.manual_seed(0)
    cfg = fpscale.load_config(None, ["model.vocab_size=32", "model.d_model=32", "model.n_heads=4",
                                     "model.max_seq_len=16", "data.seq_len=12", "model.layers.0.type=attn",
                                     f"model.tie_embeddings={str(tied).lower()}"])
    whole = fpscale.build_model(cfg).double()
    split = parallelize(copy.deepcopy(whole), state)
    whole.cfg.loss_chunk = 0                 # the plain head, one process
    split.cfg = copy.deepcopy(split.cfg)
    split.cfg.loss_chunk = 5                 # 3 x 12 tokens: chunks of 5, ..., 1
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (3, 12), generator=g)
    targets = torch.randint(0, 32, (3, 12), generator=g)
    targets[1, :3] = -100
    losses = []
    for model in (whole, split):
        model.train()
        loss = model(tokens, targets=targets)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) <= 1e-10 * abs(losses[0]), losses
    params = dict(split.named_parameters())
    for n, p in whole.named_parameters():
        got = params[n].grad
        if getattr(params[n], "tensor_model_parallel", False):
            pieces = [torch.empty_like(got) for _ in range(state.tp_size)]
            dist.all_gather(pieces, got.contiguous(), group=state.tp_group)
            got = unshard(pieces, params[n].partition_dim, params[n].tp_parts)
        assert torch.allclose(got, p.grad, rtol=1e-9, atol=1e-12), (tied, n, (got - p.grad).abs().max().item())


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    state = ParallelState(rank=rank, world_size=world, local_rank=rank, tp_size=world, tp_rank=rank,
                          dp_size=1, dp_rank=0, tp_group=group, dp_group=None, device=torch.device("cpu"))
    head_case(rank, world, group)
    for tied in (True, False):
        model_case(state, tied)
    dist.barrier()
    if rank == 0:
        open(os.path.join(out, "ok"), "w").write("ok\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
