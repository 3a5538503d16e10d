"""The device check that every layout test runs under (tests/parallel/device_check.py) has teeth:
a tensor created without naming its device, as ``Trainer.dp_mean`` and ``global_grad_norm`` once
made them, is refused by the collective it reaches; one on the compute device passes."""
import pytest
import torch
import torch.distributed as dist

from fpscale.errors import LayoutError
from tests.parallel.device_check import OffDeviceCollective, checked_collectives, unnamed_device_is_meta


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_host_made_tensor_is_refused_by_its_collective(one_rank_group):
    compute = torch.device("cpu")
    with checked_collectives(compute) as seen, unnamed_device_is_meta():
        loss = torch.ones((), device=compute)
        dist.all_reduce(loss.clone())                             # on the compute device: passes
        with pytest.raises(OffDeviceCollective, match=r"torch.distributed.all_reduce was handed a tensor on "
                                                      r"meta \(shape \(1,\)\), the compute device is cpu"):
            dist.all_reduce(torch.tensor([float(loss)], dtype=torch.float64))    # the old dp_mean
        squares = torch.zeros((), dtype=torch.float64)                          # the old global_grad_norm
        squares += loss.double()
        with pytest.raises(OffDeviceCollective, match="all_gather_into_tensor"):
            dist.all_gather_into_tensor(torch.empty(1, device=compute), squares.reshape(1))
    assert seen["all_reduce"] >= 1
    assert torch.tensor(0.0).device.type == "cpu" and dist.all_reduce.__name__ == "all_reduce"   # restored


@pytest.mark.parametrize("visible,local_rank,want", [(8, 3, "cuda:3"), (1, 3, "cuda:0"), (1, 0, "cuda:0")])
def test_each_process_takes_its_own_gpu(monkeypatch, visible, local_rank, want):
    """cuda:LOCAL_RANK when the process sees the node's GPUs; its only GPU when the scheduler bound
    it to one (evaluate.sbatch's old --gpus-per-task=1 with two tasks asked cuda:1 of one GPU)."""
    from fpscale.parallel.state import compute_device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert str(compute_device(local_rank)) == want


def test_a_rank_without_a_gpu_of_its_own_is_an_error(monkeypatch):
    from fpscale.parallel.state import compute_device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(LayoutError, match=r"LOCAL_RANK 3 but this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"):
        compute_device(3)


def test_the_gradient_norm_never_copies_a_gradient_to_the_host():
    """What the collective check cannot see on CPU (an explicit ``.cpu()``, ``.item()`` or ``float()``
    of a gradient: the old global_grad_norm moved every gradient to the host, one transfer per
    parameter): gradients on ``meta`` stand in for gradients on a GPU, and any host read of one
    raises. The norm stays a tensor on the gradients' device; on real tensors it is the L2 norm."""
    from fpscale.parallel.layers import global_grad_norm

    def params(device, fill):
        out = []
        for shape, split in (((4, 3), True), ((5,), False), ((2, 2), False)):
            p = torch.nn.Parameter(torch.empty(shape, device=device))
            p.grad = torch.full(shape, fill, device=device)
            if split:
                p.tensor_model_parallel = True
            out.append(p)
        return out

    norm = global_grad_norm(params("meta", 2.0), None)         # no host read: nothing raises
    assert norm.device.type == "meta" and norm.shape == ()
    assert float(global_grad_norm(params("cpu", 2.0), None)) == pytest.approx((4 * (12 + 5 + 4)) ** 0.5)
