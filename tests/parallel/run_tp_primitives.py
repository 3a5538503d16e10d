"""Under torchrun with 2 processes: every TP primitive against the dense computation.

Each rank builds the same dense tensors (same seed), runs the sharded version on its slice and
checks outputs and gradients against the dense result; rank 0 writes OUT/ok on success.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fpscale.parallel.layers import (  # noqa: E402
    column_parallel_linear,
    row_parallel_linear,
    shard,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from fpscale.parallel.mappings import gather_from_tp, scatter_to_tp  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    d, h, V, N = 8, 12, 10, 6
    x = torch.randn(N, d, dtype=torch.float64)
    w1 = torch.randn(h, d, dtype=torch.float64)
    w2 = torch.randn(d, h, dtype=torch.float64)

    # column -> row parallel MLP: output and gradients of input and weights
    xd, w1d, w2d = (t.clone().requires_grad_() for t in (x, w1, w2))
    F.linear(torch.tanh(F.linear(xd, w1d)), w2d).pow(2).sum().backward()
    xs = x.clone().requires_grad_()
    w1s = shard(w1, 0, rank, world).requires_grad_()
    w2s = shard(w2, 1, rank, world).requires_grad_()
    y = row_parallel_linear(torch.tanh(column_parallel_linear(xs, w1s, group)), w2s, group)
    y.pow(2).sum().backward()
    assert torch.allclose(y, F.linear(torch.tanh(F.linear(x, w1)), w2), **TOL)
    assert torch.allclose(xs.grad, xd.grad, **TOL)
    assert torch.allclose(w1s.grad, shard(w1d.grad, 0, rank, world), **TOL)
    assert torch.allclose(w2s.grad, shard(w2d.grad, 1, rank, world), **TOL)

    # gather / scatter are conjugate
    xs = x.clone().requires_grad_()
    z = gather_from_tp(scatter_to_tp(xs, group) * 3.0, group)
    z.sum().backward()
    assert torch.allclose(z, 3 * x, **TOL) and torch.allclose(xs.grad, torch.full_like(x, 3.0), **TOL)

    # vocab-parallel embedding
    table = torch.randn(V, d, dtype=torch.float64)
    tokens = torch.tensor([[0, 4, 5, 9], [3, 7, 1, 6]])
    td = table.clone().requires_grad_()
    F.embedding(tokens, td).pow(2).sum().backward()
    ts = shard(table, 0, rank, world).requires_grad_()
    e = vocab_parallel_embedding(tokens, ts, group)
    e.pow(2).sum().backward()
    assert torch.allclose(e, F.embedding(tokens, table), **TOL)
    assert torch.allclose(ts.grad, shard(td.grad, 0, rank, world), **TOL)

    # vocab-parallel cross-entropy (with an ignored target) never sees the full logits
    logits = torch.randn(N, V, dtype=torch.float64) * 3
    targets = torch.tensor([0, 9, 4, 5, -100, 2])
    ld = logits.clone().requires_grad_()
    ref = F.cross_entropy(ld, targets, ignore_index=-100)
    ref.backward()
    ls = shard(logits, 1, rank, world).requires_grad_()
    loss = vocab_parallel_cross_entropy(ls, targets, group)
    loss.backward()
    assert torch.allclose(loss.double(), ref, **TOL), (float(loss), float(ref))
    assert torch.allclose(ls.grad, shard(ld.grad, 1, rank, world), **TOL)

    # bf16 logits: the loss is computed in fp32, the gradient comes back in bf16
    lb = shard(logits, 1, rank, world).to(torch.bfloat16).requires_grad_()
    loss16 = vocab_parallel_cross_entropy(lb, targets, group)
    loss16.backward()
    ref16 = F.cross_entropy(logits.to(torch.bfloat16).float(), targets, ignore_index=-100)
    assert loss16.dtype == torch.float32 and abs(float(loss16) - float(ref16)) < 1e-5
    assert lb.grad.dtype == torch.bfloat16

    dist.barrier()
    if rank == 0:
        open(os.path.join(out, "ok"), "w").write("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
