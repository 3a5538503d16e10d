"""The numerics a run computes in, shared by training, training-time validation and evaluation.

    train.precision   forward / validation                 fp32 matmuls on CUDA
    bf16              bf16 autocast (weights, optimizer     IEEE fp32 (the fp32 islands of the bf16
                      and the solver state stay fp32)       policy, fpscale.solvers.precision: the
                                                            scan, spectral norms, stay fp32)
    fp32              no autocast                           TF32 tensor cores (~8x an H100's IEEE
                                                            fp32 rate); the solver's tolerances
                                                            are raised to what TF32 resolves

Evaluation (launch/evaluate.py ``--precision``) runs in the checkpoint's ``train.precision`` by
default (``config``), so its losses and iteration counts are the ones training-time validation
reported; ``fp32`` / ``bf16`` ask for another, ``fp32-strict`` for IEEE fp32 everywhere (TF32 off:
what evaluation did before, at 1/15 of an H100's bf16 rate).
"""
from __future__ import annotations

import torch

from fpscale.errors import UserError

TRAIN_PRECISIONS = ("fp32", "bf16")
EVAL_PRECISIONS = ("config", "fp32", "bf16", "fp32-strict")


def autocast(precision: str, device: torch.device):
    """The autocast context of ``precision`` on ``device``: bf16 autocast for ``bf16``, autocast
    off otherwise (a fresh context manager per call: use it as ``with autocast(p, dev):``)."""
    check_precision(precision, EVAL_PRECISIONS[1:], "precision")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def set_matmul_precision(precision: str, device: torch.device) -> None:
    """On CUDA, TF32 tensor cores for the fp32 matmuls of an ``fp32`` run, IEEE fp32 for ``bf16``
    and ``fp32-strict``. The one place fpscale sets it: the Trainer and evaluation call it for the
    device they run on. It is torch's process-wide flag (the legacy ``allow_tf32`` API, which
    ``Trainer.compute_record`` reads for the MFU peak: torch refuses a mix of the two APIs)."""
    check_precision(precision, EVAL_PRECISIONS[1:], "precision")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision == "fp32"


def eval_precision(flag: str, trained: str) -> str:
    """The precision an evaluation runs in: ``config`` is the run's ``train.precision``."""
    check_precision(flag, EVAL_PRECISIONS)
    return trained if flag == "config" else flag


def check_precision(value: str, allowed: tuple[str, ...] = EVAL_PRECISIONS, what: str = "--precision") -> None:
    """A UserError naming ``what`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
