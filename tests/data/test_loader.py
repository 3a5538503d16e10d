"""The global order: DP-size independence, exact resume, fixed validation batches; for one
prepared folder and for a blend of three sources (``dataset``)."""
import numpy as np
import pytest
import torch

from fpscale.data.loader import DistributedBatches, validation_batches
from fpscale.data.shards import TokenShards
from tests.data.conftest import blend_config


@pytest.fixture(scope="module")
def shards(prepared):
    return TokenShards(prepared + "/tokens", "train", 16)


@pytest.fixture(scope="module", params=["shards", "blend"])
def dataset(request, shards, blend_sources):
    """One prepared folder, or the 0.5 / 0.3 / 0.2 blend of three (whose smallest source wraps
    its epoch several times in the first block)."""
    if request.param == "shards":
        return shards
    from fpscale.data.blend import open_blend
    return open_blend(blend_config(blend_sources))[0]


def boundary(dataset) -> int:
    """A position 20 samples before an order boundary: the single source's epoch, the blend's block."""
    from fpscale.data.blend import BLOCK, Blend
    return (BLOCK if isinstance(dataset, Blend) else dataset.num_samples) - 20


def test_samples_are_windows_of_the_stream(shards):
    stream = np.concatenate([a for a in shards.arrays])
    for i in (0, 1, shards.num_samples // 2, shards.num_samples - 1):   # some cross shard boundaries
        assert np.array_equal(shards.sample(i), stream[i * 16: i * 16 + 17])
    assert shards.num_samples == (len(stream) - 1) // 16


def global_batches(shards, dp, steps, consumed=0, micro=2, global_batch=8):
    """What the ``dp`` ranks read, step by step: [step][rank] -> that rank's micro-batches concatenated."""
    ranks = [DistributedBatches(shards, global_batch, micro, r, dp, seed=7, consumed_samples=consumed)
             for r in range(dp)]
    return [[torch.cat(r.next_global_batch()) for r in ranks] for _ in range(steps)], ranks


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_ranks_read_their_slice_of_the_one_process_global_batch(dataset, dp):
    """In every global step, rank r of ``dp`` reads the r-th contiguous slice of what one process
    reads (micro-batch = the whole global batch), in the same order, so the ranks' union is the
    one-process batch for any DP size. Starts 20 samples before an epoch ends (a blend: a block),
    so the steps cross into the next epoch's permutation (the next block's)."""
    shards = dataset
    G, steps = 8, 6
    start = boundary(shards)
    one_process = DistributedBatches(shards, G, G, seed=7, consumed_samples=start)
    whole = [one_process.next_global_batch() for _ in range(steps)]
    assert all(len(w) == 1 for w in whole)
    read, ranks = global_batches(shards, dp, steps, consumed=start, global_batch=G)
    for (batch,), per_rank in zip(whole, read):
        assert len({tuple(x.tolist()) for x in batch}) == G        # distinct samples: the comparison means something
        for r, part in enumerate(per_rank):
            assert torch.equal(part, batch[r * G // dp:(r + 1) * G // dp]), (dp, r)
    assert all(r.consumed_samples == one_process.consumed_samples == start + steps * G for r in ranks)
    assert len({r.state().fingerprint for r in ranks}) == 1


def test_resume_continues_the_stream_exactly(dataset):
    shards = dataset
    full, ranks = global_batches(shards, 2, 10)
    state = ranks[0].state()
    assert state.consumed_samples == 80
    resumed, _ = global_batches(shards, 4, 6, consumed=32)         # resume at n = 32 on another DP size
    for a, b in zip(full[4:], resumed):
        assert torch.equal(torch.cat(a), torch.cat(b))


def test_epochs_wrap_with_a_new_permutation(shards):
    n = shards.num_samples
    loader = DistributedBatches(shards, 8, 8, seed=1)
    first = loader.order.indices(0, n)
    second = loader.order.indices(n, n)
    assert sorted(first) == sorted(second) == list(range(n)) and not np.array_equal(first, second)


def test_validation_batches_are_fixed(prepared):
    val = TokenShards(prepared + "/tokens", "val", 16)
    a = validation_batches(val, 2, 3)
    b = validation_batches(val, 2, 3)
    assert all(torch.equal(x, y) and cx and cy for (x, cx), (y, cy) in zip(a, b))


def test_validation_batches_keep_every_rank_busy(prepared):
    """Fewer batches than ranks: every rank still runs the same number of forwards (under ZeRO-3
    each forward gathers parameters with all ranks), the extra turns are not counted, and the
    counted batches are the same whole batches as on one rank."""
    val = TokenShards(prepared + "/tokens", "val", 16)
    whole = [b for b, counted in validation_batches(val, 2, 3)]
    for dp in (2, 4, 5):
        dealt = [validation_batches(val, 2, 3, rank, dp) for rank in range(dp)]
        assert len({len(d) for d in dealt}) == 1, dp
        counted = [(r, i, b) for r, d in enumerate(dealt) for i, (b, c) in enumerate(d) if c]
        ordered = [b for _, _, b in sorted(counted, key=lambda t: (t[1], t[0]))]
        assert len(ordered) == 3 and all(torch.equal(x, y) for x, y in zip(ordered, whole)), dp


def test_bad_batch_geometry_names_the_numbers(shards):
    with pytest.raises(ValueError, match="global batch 10 is not a multiple of micro batch 2 x data-parallel size 4"):
        DistributedBatches(shards, 10, 2, 0, 4)
