"""The training step on the device's terms, counted on CPU with fpscale.profiling.count_syncs (a dispatch
mode seeing ``aten._local_scalar_dense`` and the reading Tensor methods): with torch's fused AdamW (what
CUDA runs; forced on CPU here) one host read per step, the loss and the gradient norm together, and none in
the forward of a plain stack; a non-finite step skipped on the device; the next step's batches prefetched
without moving the loader."""
import pytest
import torch

import fpscale
from fpscale.profiling import count_syncs
from fpscale.train import optim
from fpscale.train.trainer import Trainer

TINY = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=64", "model.d_model=32", "model.n_heads=2",
        "train.micro_batch=2", "train.global_batch=4", "train.global_batch_tokens=0", "train.steps=4",
        "train.warmup=1", "train.resume=none", "train.loggers=[]", "train.save_interval=0",
        "train.save_interval_minutes=0", "train.export_final=false"]


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(optim, "fused_by_default", lambda params: True)


def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(fpscale.load_config("configs/tiny_attn.yaml", [*TINY, f"train.out_dir={tmp_path}", *extra]),
                   log=False)


def test_fused_adamw_is_cuda_only_by_default():
    assert not optim.fused_by_default([torch.nn.Parameter(torch.zeros(2))])
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert not opt.skips_on_device and not opt.defaults["fused"]


def test_one_host_read_per_training_step(tmp_path, fused_on_cpu):
    with trainer(tmp_path) as t:
        assert t.optimizer.skips_on_device and t.optimizer.defaults["fused"]
        t.train_step()                                   # the first step allocates the optimizer's state
        for _ in range(2):                               # two micro-batches a step (accumulation)
            with count_syncs() as syncs:
                out = t.train_step()
            assert syncs.by_kind == {"Tensor.tolist": 1}, syncs.by_kind
            assert out["tokens"] == 4 * 16 and not out["skipped"]


def test_the_forward_of_a_plain_stack_reads_nothing(tmp_path):
    with trainer(tmp_path) as t:
        tokens = torch.randint(0, 64, (2, 17))
        with count_syncs() as syncs:
            loss = t.model(tokens[:, :-1], targets=tokens[:, 1:])
        assert syncs.total == 0, syncs.by_kind
        with count_syncs() as syncs:
            loss.backward()
        assert syncs.total == 0, syncs.by_kind


def test_a_non_finite_step_is_skipped_on_the_device(tmp_path, fused_on_cpu, monkeypatch):
    with trainer(tmp_path) as t:
        t.train_step()
        before = [p.detach().clone() for p in t.model.parameters()]
        steps = [s["step"].clone() for s in t.optimizer.state.values()]
        real = torch.nn.utils.clip_grad_norm_
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                            lambda params, max_norm: real(params, max_norm) * float("inf"))
        out = t.train_step()
        assert out["skipped"] and t.progress.skipped_steps == 1
        for a, b in zip(before, t.model.parameters()):
            assert torch.equal(a, b)
        assert all(torch.equal(a, s["step"]) for a, s in zip(steps, t.optimizer.state.values()))
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real)
        assert not t.train_step()["skipped"]
        assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


def test_prefetch_reads_the_next_steps_batches_without_moving_the_loader(tmp_path):
    with trainer(tmp_path) as t:
        t.train_step()
        position = t.batches.consumed_samples
        assert t.ahead is not None and t.ahead[0] == position
        expected = t.batches.peek_global_batch()
        assert t.batches.consumed_samples == position
        assert all(torch.equal(a, b) for a, b in zip(t.ahead[1], expected))
        assert all(torch.equal(a, b) for a, b in zip(t.next_batches(), expected))
        assert t.batches.consumed_samples == position + 4 and t.ahead is None


def test_an_interval_of_skipped_steps_is_said_loudly(tmp_path, monkeypatch):
    """Every step of a log interval skipped (a non-finite gradient each time): the weights have not moved and
    the run says so, once per interval (tiny_epsilon trained 250 of 300 steps this way before 5289051 and
    its log said only "skipped N")."""
    import fpscale.train.trainer as trainer_module
    warned = []
    monkeypatch.setattr(trainer_module.logger, "warning", lambda msg, *args: warned.append(msg % args))
    with trainer(tmp_path, "train.log_interval=2", "train.eval_interval=100") as t:
        real = torch.nn.utils.clip_grad_norm_
        t.train_step()
        t.train_step()                                          # steps 1-2 applied: nothing to say
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                            lambda params, max_norm: real(params, max_norm) * float("nan"))
        t.cfg.train.steps = 6
        t.train()
    assert t.progress.skipped_steps == 4
    assert warned == ["steps 3-4 all skipped (non-finite gradient norm; 2 of 4 so far): the weights did not change",
                      "steps 5-6 all skipped (non-finite gradient norm; 4 of 6 so far): the weights did not change"]
