"""The optimizer's config: ``train.muon`` and the checks of the per-group keys of ``train``
(``lr_scale``, ``group_weight_decay``, ``group_betas``, ``group_override``). docs/optimizers.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fpscale.errors import check

# the parameter groups by role (fpscale/train/optimizers.py ``role``)
GROUPS = ("muon", "matrix", "other", "embed", "head", "norm", "scalar")


@dataclass
class MuonConfig:
    """Muon's settings (fpscale/train/muon.py). ``weight_decay`` None: ``train.weight_decay``.
    ``momentum_warmup`` steps raise the momentum linearly from ``momentum_start`` (modded-nanogpt and
    Attractor: 0.85 -> 0.95 over 300 steps; 0 = off). ``shape_scale``: ``moonlight`` 0.2 sqrt(max dim),
    whose updates have AdamW's RMS so Muon shares ``train.lr``; ``keller`` max(1, rows/cols)^0.5,
    whose recipes give Muon its own lr (0.02-0.05: set ``train.lr_scale.muon`` = that / train.lr).
    ``ns_dtype: auto``: Newton-Schulz in bf16 on a GPU (the recipes'), in fp32 on a CPU, where bf16 matmuls
    are slower than fp32 ones (8x for a 384 x 128 matrix on the 2-core build machine, 1 thread).
    ``normuon``: Attractor's per-row second moment of the orthogonalised update (NorMuon; ``normuon_beta2``
    its average, theirs 0.95: recpre/optim/muon_adamw.py:84). ``wd_scale``: ``lr`` decay lr x wd (Keller's),
    ``step`` lr x shape scale x wd (Attractor's: muon_adamw.py:47, their lr carries the shape scale).
    ``wd_schedule``: ``constant``, or ``linear`` from ``weight_decay`` to 0 at train.steps (their
    scripts/train.py:698-702: wd x (1 - step / max_steps)). ``split_fused``: fused projections (q/k/v)
    orthogonalised part by part (Keller's records, Attractor's separate c_q, c_k, c_v); off: one matrix."""
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: Literal["auto", "bf16", "fp32", "fp64"] = "auto"    # auto: bf16 on GPUs, fp32 on CPUs
    ns_coefficients: Literal["quintic", "polar_express"] = "quintic"
    shape_scale: Literal["moonlight", "keller"] = "moonlight"
    cautious_wd: bool = True
    weight_decay: float | None = None
    momentum_warmup: int = 0
    momentum_start: float = 0.85
    normuon: bool = False
    normuon_beta2: float = 0.95
    wd_scale: Literal["lr", "step"] = "lr"
    wd_schedule: Literal["constant", "linear"] = "constant"
    split_fused: bool = True

    def validate(self, prefix: str = "train.muon") -> None:
        check(0 <= self.momentum < 1, f"{prefix}.momentum", f"must be in [0, 1), got {self.momentum}")
        check(0 <= self.momentum_start < 1, f"{prefix}.momentum_start",
              f"must be in [0, 1), got {self.momentum_start}")
        check(self.momentum_warmup >= 0, f"{prefix}.momentum_warmup",
              f"must be >= 0 (0 = off), got {self.momentum_warmup}")
        check(0 <= self.normuon_beta2 < 1, f"{prefix}.normuon_beta2",
              f"must be in [0, 1), got {self.normuon_beta2}")
        limit = 5 if self.ns_coefficients == "polar_express" else 50
        check(1 <= self.ns_steps <= limit, f"{prefix}.ns_steps",
              f"must be in 1..{limit} with ns_coefficients {self.ns_coefficients}, got {self.ns_steps}")
        check(self.weight_decay is None or self.weight_decay >= 0, f"{prefix}.weight_decay",
              f"must be >= 0 (or null: train.weight_decay), got {self.weight_decay}")


def check_groups(t, prefix: str = "train") -> None:
    """The per-group keys of TrainConfig ``t``: known group names, sane values."""
    known = ", ".join(GROUPS)
    for key, table in (("lr_scale", t.lr_scale), ("group_weight_decay", t.group_weight_decay),
                       ("group_betas", t.group_betas)):
        for name, value in table.items():
            where = f"{prefix}.{key}.{name}"
            check(name in GROUPS, where, f"unknown parameter group {name!r}; groups: {known}")
            if key == "lr_scale":
                check(value > 0, where, f"must be > 0, got {value}")
            elif key == "group_weight_decay":
                check(value >= 0, where, f"must be >= 0, got {value}")
            else:
                check(len(value) == 2 and all(0 <= b < 1 for b in value), where,
                      f"must be [beta1, beta2], each in [0, 1), got {value}")
    for name, group in t.group_override.items():
        where = f"{prefix}.group_override.{name}"
        check(group in GROUPS, where, f"unknown parameter group {group!r}; groups: {known}")
        check(group != "muon" or t.optimizer == "muon_adamw", where,
              f"puts parameters in muon, but train.optimizer is {t.optimizer} (set muon_adamw)")
    check(t.schedule != "wsd" or 0 < t.decay_fraction <= 1, f"{prefix}.decay_fraction",
          f"must be in (0, 1] (the fraction of train.steps spent decaying), got {t.decay_fraction}")
    if t.schedule == "wsd":
        decay = round(t.decay_fraction * t.steps)
        check(t.warmup + decay <= t.steps, f"{prefix}.decay_fraction",
              f"warm-up ({t.warmup}) + decay ({decay} = {t.decay_fraction} x {t.steps}) exceed train.steps")
    t.muon.validate(f"{prefix}.muon")
