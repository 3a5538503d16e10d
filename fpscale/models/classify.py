"""A pooled classification head over any fpscale LM (every layer type): the stack's final hidden
states (after its norm), pooled over each row's real tokens, then one linear layer to the classes.

    clf = PooledClassifier(fpscale.build_model(cfg), n_classes=2, pool="mean")
    logits = clf(tokens, pad=pad)                 # [B, n_classes]; pad [B]: each row's left padding
    loss = clf.loss(tokens, labels, pad=pad)      # cross-entropy + the looped layers' auxiliary losses

pool   mean   the mean over the real tokens (left padding excluded): every token's state counts
       last   the last token's state (causal stacks: the one that has read the whole row)
The LM's output head is not used. In training the loss adds what the LM's looped layers put in
``aux_loss`` (epsilon's KL and bin entropy, fpsa_lh's ponder cost), as the LM's own loss does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fpscale.errors import check

POOLS = ("mean", "last")


class PooledClassifier(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, n_classes: int, pool: str = "mean"):
        super().__init__()
        check(pool in POOLS, "pool", f"must be one of {', '.join(POOLS)}, got {pool!r}")
        check(n_classes >= 2, "n_classes", f"must be >= 2, got {n_classes}")
        self.lm, self.pool = lm, pool
        d = lm.cfg.d_model
        self.proj = torch.nn.Linear(d, n_classes)
        torch.nn.init.normal_(self.proj.weight, std=d ** -0.5)
        torch.nn.init.zeros_(self.proj.bias)

    def features(self, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """[B, d] pooled hidden states."""
        h = self.lm.hidden(tokens, pad=pad)
        if self.pool == "last":
            return h[:, -1]
        if pad is None:
            return h.mean(1)
        real = (torch.arange(tokens.shape[1], device=tokens.device)[None] >= pad[:, None]).to(h.dtype)
        return (h * real[..., None]).sum(1) / real.sum(1, keepdim=True).clamp_min(1)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.features(tokens, pad).to(self.proj.weight.dtype))

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        ce = F.cross_entropy(self(tokens, pad).float(), labels)
        aux = self.lm.aux_loss() if self.training else None
        return ce if aux is None else ce + aux
