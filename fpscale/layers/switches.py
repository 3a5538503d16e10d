"""Block switches that ``attn`` and ``attractor`` share, for jacobfa/Attractor's blocks (issue 38):
``mlp: relu2`` (proj(0.5 relu(fc x)^2)), ``init: scaled_zero_ortho`` (their ``scaled-zero`` init
with ``init_orthogonal``) and the pieces they need. ``qk_norm`` lives in
fpscale.layers.common.self_attention. The RoPE layout needs no switch: their pair-interleaved
rotation equals fpscale's half-split one after permuting each head's q/k rows
(fpscale.models.attractor_weights), exactly.

Their init (attractor/utils/init.py:86-90 ``scaled-zero``, :237-281 the orthogonal form, :331 its choice):
q, k, v and the MLP's fc trunc-orthogonal with std sqrt(2/(5d)); the output projections of the
attention and MLP zero in the backbone; in the head the zeros are replaced by a normal of the same
std truncated at 3 std (attractor.py:139-152); norm weights ones; the embedding trunc-orthogonal with
the same std (attractor.py:296: ``embedding`` is not in the table, so its ``std`` applies).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from fpscale.layers.common import TPSplit, Unsharded, init_linear, swiglu_hidden

MLP_KINDS = ("swiglu", "relu2")
INITS = ("fpscale", "scaled_zero_ortho")


def relu2(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    """proj(0.5 relu(fc x)^2): jacobfa/Attractor's MLP (attractor/modules/basic.py:21-27, mlp.py:21-22)."""
    return F.linear(F.relu(F.linear(x, w_fc)).pow(2).mul(0.5), w_proj)


@torch.no_grad()
def trunc_orthogonal_(w: torch.Tensor, std: float) -> torch.Tensor:
    """A (semi-)orthogonal matrix from the QR of a truncated standard normal (|x| <= 2), signs fixed
    by R's diagonal, scaled so its entries have std ``std`` (gain std sqrt(max(rows, cols))): the
    ``init_orthogonal`` of jacobfa/Attractor (attractor/utils/init.py:237-281). The last two dims of
    ``w`` are one matrix; leading dims are a stack of them."""
    rows, cols = w.shape[-2], w.shape[-1]
    for idx in itertools.product(*map(range, w.shape[:-2])):
        m = w[idx]
        a = torch.nn.init.trunc_normal_(torch.empty(rows, cols, dtype=torch.float64), 0.0, 1.0)
        tall = a if rows >= cols else a.t()
        q, r = torch.linalg.qr(tall)
        q = q * torch.sign(torch.diagonal(r))
        m.copy_((q if rows >= cols else q.t()) * std * max(rows, cols) ** 0.5)
    return w


def scaled_zero_ortho(d_model: int) -> float:
    """The std of jacobfa/Attractor's ``scaled-zero`` init, sqrt(2 / (5 d)) (attractor/utils/init.py:86-90)."""
    return (2.0 / (5.0 * d_model)) ** 0.5


@torch.no_grad()
def trunc_normal_3(w: torch.Tensor, std: float) -> torch.Tensor:
    """Normal of std ``std`` truncated at 3 std (Attractor's head output projections, attractor.py:144-152)."""
    return torch.nn.init.trunc_normal_(w, 0.0, std, -3 * std, 3 * std)


class Relu2MLP(torch.nn.Module):
    """proj(0.5 relu(fc x)^2) (``mlp: relu2``): fc column-parallel, proj row-parallel; the hidden
    size is the SwiGLU one (``swiglu_hidden``: mlp_ratio 4 gives Attractor's 4d)."""

    def __init__(self, d_model: int, mlp_ratio: float, init_std: float, out_std: float):
        super().__init__()
        hidden = swiglu_hidden(d_model, mlp_ratio)
        self.w_fc = torch.nn.Parameter(torch.empty(hidden, d_model))
        self.w_proj = torch.nn.Parameter(torch.empty(d_model, hidden))
        init_linear(self.w_fc, init_std)
        init_linear(self.w_proj, out_std)
        self.shards = Unsharded()

    def tp_plan(self) -> dict[str, TPSplit]:
        return {"w_fc": TPSplit(0), "w_proj": TPSplit(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.exit(relu2(self.shards.enter(x), self.w_fc, self.w_proj))


def scaled_zero_ortho_(w: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """``w`` (or each of its ``parts`` equal row blocks: fused q/k/v) trunc-orthogonal at Attractor's std."""
    std = scaled_zero_ortho(w.shape[-1])
    for block in w.chunk(parts, dim=-2):
        trunc_orthogonal_(block, std)
    return w


VE_GATE_CHANNELS = 32       # their gate reads the first 32 channels of the normalised input (mixer.py:43)


class ValueEmbedding(torch.nn.Module):
    """``value_embed: true`` on ``attn``: a per-layer token table added to the values, gated per head,
    as jacobfa/Attractor's GPT baselines do (attractor/modules/mixer.py:18-20, 43-47, 64-69; gpt.py:39-42,
    115-116): v += 2 sigmoid(W_g h[..., :32]) * table[token] per head, h the attention's normalised input.
    The table starts N(0, 1) (torch.nn.Embedding's default: their init never touches it), W_g as
    torch.nn.Linear's default. The LM sets ``tokens`` before each forward (``LoopedLM.hidden``).
    Under TP the table's columns and the gate's rows split by heads, as the values do."""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab_size, d_model))
        self.gate = torch.nn.Parameter(torch.empty(n_heads, VE_GATE_CHANNELS))
        bound = 1 / VE_GATE_CHANNELS ** 0.5
        torch.nn.init.uniform_(self.gate, -bound, bound)
        self.tokens: torch.Tensor | None = None

    def tp_plan(self) -> dict[str, TPSplit]:
        return {"table": TPSplit(1), "gate": TPSplit(0)}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The term added to this shard's values [B, T, heads x head_dim] for the normalised input h."""
        if self.tokens is None or self.tokens.shape != h.shape[:2]:
            raise RuntimeError("value_embed: the layer needs the token ids of its input (LoopedLM sets them; "
                               "a layer called outside LoopedLM.hidden has none)")
        gate = 2 * torch.sigmoid(F.linear(h[..., :VE_GATE_CHANNELS], self.gate))          # [B, T, heads]
        ve = F.embedding(self.tokens, self.table)
        heads = self.gate.shape[0]
        return (ve.view(*ve.shape[:2], heads, -1) * gate[..., None].to(ve.dtype)).flatten(2)
