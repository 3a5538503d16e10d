"""What a run starts from: its datasets, the initial model every rank builds, and the checks that need
more than one config section (the layout beside the model). The trainer (fpscale.train.trainer) calls
them; evaluation and the experiments build their datasets the same way.
"""
from __future__ import annotations

import torch

from fpscale.config import Config
from fpscale.errors import check
from fpscale.models import build_model
from fpscale.parallel.state import ParallelState
from fpscale.train import checkpoint


def build_datasets(cfg: Config):
    """(train, validation) datasets for the configured source."""
    d = cfg.data
    if d.source == "synthetic":
        from fpscale.data.synthetic import SyntheticTask
        return (SyntheticTask(d.task, cfg.model.vocab_size, d.seq_len, cfg.seed, d.period),
                SyntheticTask(d.task, cfg.model.vocab_size, d.seq_len, cfg.seed + 1_000_003, d.period))
    if d.blend:
        from fpscale.data.blend import open_blend
        return open_blend(d)
    from fpscale.data.blend import check_data
    from fpscale.data.shards import TokenShards
    check_data(d, cfg.model.vocab_size)           # a Megatron prefix as data.path, the vocabulary
    train = TokenShards(d.path, "train", d.seq_len)
    val = TokenShards(d.path, "val", d.seq_len)
    train.check_vocab(cfg.model.vocab_size)
    return train, val


def initial_model(cfg: Config, state: ParallelState) -> torch.nn.Module:
    """The plain model every rank starts from: built from ``cfg.seed`` (the same initial weights
    on every rank), or holding the whole weights of ``train.init_weights``."""
    torch.manual_seed(cfg.seed)
    if not cfg.train.init_weights:
        return build_model(cfg)
    try:
        model, _ = checkpoint.load_model(cfg.train.init_weights, state, cfg)
    except checkpoint.CheckpointError as exc:
        raise checkpoint.CheckpointError(f"train.init_weights: {exc}") from None
    return model


def check_deep_supervision(cfg: Config, dp_size: int) -> None:
    """Under ZeRO-3 with several data-parallel ranks, a layer with deep supervision gathers the rest of
    the model's parameters once per window over the DP group: every rank must take the same windows,
    so the stop is agreed over DP (``solver.forward.agree: dp``; fpscale.layers.deep_supervision)."""
    if dp_size < 2 or cfg.parallel.zero_stage != 3:
        return
    for i, spec in enumerate(cfg.model.layers):
        if spec.looped and spec.deep_supervision.window > 0:
            own = spec.solver.get("forward", {})
            agree = own.get("agree", cfg.solver.agree)
            key = f"model.layers.{i}.solver.forward.agree" if "agree" in own else "solver.forward.agree"
            check(agree == "dp", key, f"must be dp where model.layers.{i}.deep_supervision is on under ZeRO-3 with "
                                      f"{dp_size} data-parallel ranks (each window gathers the parameters over DP: "
                                      f"the ranks must take the same windows), got {agree}")
