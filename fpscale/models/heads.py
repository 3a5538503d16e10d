"""The language-model head: logits from the final hidden states and the output weight, and their
loss (whole, or chunked straight from the hidden states: fpscale.ops.chunked_loss). The pooled
classification head is fpscale.models.classify."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fpscale.ops.chunked_loss import chunked_cross_entropy
from fpscale.ops.fused_loss import choose, fused_cross_entropy


class LMHead(torch.nn.Module):
    """Logits over the whole vocabulary from the final hidden states and the output weight (the
    tied embedding or the untied head; it holds no parameter itself), and their cross-entropy
    with the softmax in at least float32; ``chunked_loss`` is that cross-entropy straight from the
    hidden states, never holding more than a chunk of logits (the model's default for its loss,
    ``model.loss_chunk``). fpscale.parallel swaps in the vocabulary-parallel head."""

    sharded_logits = False       # True where each rank holds a vocabulary slice of the logits
    kernel = "chunked"           # model.loss_kernel: chunked, or liger (fpscale.ops.fused_loss)

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):      # the softmax in fp32, never below
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def chunked_loss(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        """``loss(forward(h, weight), targets)`` without the logits: ``chunk`` tokens at a time,
        saving only the logsumexp per token for the backward (fpscale.ops.chunked_loss); with
        ``kernel = "liger"``, liger-kernel's fused linear cross-entropy where Triton runs
        (fpscale.ops.fused_loss)."""
        if self.kernel != "chunked" and choose(self.kernel, h.device) == "liger":
            return fused_cross_entropy(h, weight, targets)
        return chunked_cross_entropy(h, weight, targets, chunk)
