"""The loss head from a kernel library: liger-kernel's fused linear cross-entropy (Triton; ``pip install
fpscale[liger]``, and the offline wheelhouse carries it). It takes the hidden states and the output weight,
computes the logits a chunk at a time, and in the same pass the gradients of the hidden states and of the
weight: the logits are never whole in memory and the backward does not compute them again (it scales the
stored gradients by the incoming one). fpscale's own chunked head (fpscale.ops.chunked_loss) saves the
logsumexp instead and recomputes each chunk's logits in the backward.

``model.loss_kernel``: ``chunked`` (the default everywhere until bench/loss_head.py has timed both on a GPU:
the chunked head is the one measured and proven in this project, docs/gpu.md) or ``liger``. ``liger`` runs
where Triton runs: CUDA, or a CPU under ``TRITON_INTERPRET=1`` (the tests); on a CPU otherwise the chunked
head runs instead, said once. The vocabulary-parallel head under tensor parallelism
(fpscale.parallel.layers.VocabParallelLMHead) keeps its own chunked loss: liger's kernel sees a whole vocabulary.

    loss = fused_cross_entropy(h, weight, targets)     # = F.cross_entropy(h @ weight.T, targets), mean
"""
from __future__ import annotations

import os
import warnings

import torch

from fpscale.errors import ConfigError

LOSS_KERNELS = ("chunked", "liger")
_SAID: set[str] = set()


def liger_available() -> str | None:
    """None when liger-kernel imports, else why not."""
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception as exc:          # absent, or a Triton it cannot use
        return f"{type(exc).__name__}: {exc}"
    return None


def runs_here(device: torch.device) -> bool:
    """Triton's kernels run on this device: CUDA, or anything under the interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def fused_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets`` (ignore_index -100) by liger-kernel's
    fused linear cross-entropy. ``h`` [..., d] with ``targets`` of its leading shape; under autocast both
    operands are cast to the autocast dtype (as ``F.linear`` would) and the softmax and the weight's
    gradient are accumulated in fp32."""
    why = liger_available()
    if why is not None:
        raise ConfigError("model.loss_kernel",
                          f"liger needs the liger-kernel package (pip install fpscale[liger]): {why}")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"targets {list(targets.shape)} must have the leading shape of the hidden states "
                         f"{list(h.shape)}")
    dtype = h.dtype
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
    with torch.autocast(h.device.type, enabled=False):
        return liger_fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]).to(dtype).contiguous(),
                                                weight.to(dtype), targets.reshape(-1), ignore_index=-100,
                                                accum_dtype=torch.float32)


def choose(kernel: str, device: torch.device) -> str:
    """The kernel that runs for ``model.loss_kernel: kernel`` on ``device`` (a fallback said once)."""
    if kernel == "liger" and not runs_here(device):
        if "cpu" not in _SAID:
            _SAID.add("cpu")
            warnings.warn(f"model.loss_kernel = liger: Triton does not run on {device.type} (no GPU, no "
                          "TRITON_INTERPRET=1): the chunked head runs instead", stacklevel=3)
        return "chunked"
    return kernel
