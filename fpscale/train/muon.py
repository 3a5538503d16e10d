"""MuonAdamW: Muon for the blocks' weight matrices, AdamW for everything else, in one torch optimizer
that is correct on every layout fpscale runs (one process, tensor parallel, ZeRO 0-3, bf16).

Muon (Keller Jordan, github.com/KellerJordan/Muon muon.py ``muon_update``): SGD momentum (Nesterov by
default, momentum 0.95), the update orthogonalised by Newton-Schulz, scaled by the matrix's shape:

    m <- beta m + (1 - beta) g                  (``m.lerp_(g, 1 - beta)``, kept as state ``exp_avg``)
    u <- (1 - beta) g + beta m  (Nesterov)  or  m
    O <- NS5(u)  ~  U S' V^T  with  u = U S V^T
    p <- p - lr * wd * p * mask - lr * scale(shape) * O

``scale``: ``keller`` max(1, rows / cols)^0.5 (muon.py), or ``moonlight`` 0.2 * sqrt(max(rows, cols))
(Moonlight, Liu et al. 2025: matches AdamW's update RMS so Muon can share AdamW's learning rate).
``mask``: all ones (decoupled weight decay, Keller's ``p.mul_(1 - lr * wd)``), or with ``cautious``
the elements where update and weight agree in sign, ``(O * p) >= 0`` (Attractor's MuonAdamW,
recpre/optim/muon_adamw.py ``muon_step``: ``mask = (g * p) >= 0; p.sub_(lr*g + lr*wd*p*mask)``; there
``lr`` already carries the shape scale, here the decay is lr * wd like Keller's: the same for wide and
square matrices). Deviations from Attractor stated: its NorMuon-style second moment (per-row ``v``)
is not applied, and its linear decay of the Muon weight decay to 0 is not (fpscale's decay is constant).

Newton-Schulz: the quintic X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315),
5 steps in bf16 after normalising by the Frobenius norm (muon.py ``zeropower_via_newtonschulz5``; on a CPU,
where bf16 matmuls are slower than fp32 ones, ``ns_dtype: auto`` runs them in fp32), or
Attractor's ``polar_express`` coefficients (one triple per step, normalised by 1.02 x the norm). The
quintic is not exact: it maximises the slope at zero, so the singular values land in about [0.7, 1.2]
rather than at 1 (muon.py's docstring: "S'_ii ~ Uniform(0.5, 1.5)"); tests/train/test_muon.py
compares it with U V^T on that band.

Layouts. The update of a matrix depends on the whole matrix, so wherever a rank holds a piece:
  tensor parallel   the rank's slice is all-gathered over the TP group along its split dimension
                    (``unshard``, fused q/k/v split part by part), orthogonalised whole, and the rank
                    keeps its slice (Megatron's TensorParallelMuon "gather" mode; every TP rank does the
                    same Newton-Schulz: a distributed Newton-Schulz would split that work, bench/optimizer.py
                    measures what the gather costs).
  ZeRO 1/2, bf16    DeepSpeed hands the optimizer a flat fp32 partition of each parameter group, which
                    cuts matrices anywhere; fpscale/train/muon_zero.py tells this optimizer where each
                    matrix lies in it: the Nesterov update (elementwise, on the partition) is all-gathered
                    over the DP group, each matrix touching this partition is orthogonalised whole, and
                    the rank keeps its part. Momentum stays partitioned (ZeRO's saving kept).
  ZeRO 3            the same, with ZeRO-3's per-parameter partitions.
Everything but Newton-Schulz is elementwise and runs on whatever piece the rank holds.
Checkpoints: the Muon momentum is saved as ``exp_avg`` (an exponential average of the gradient, as
AdamW's first moment) and ``state_dict`` adds a zero ``exp_avg_sq``, which DeepSpeed's universal
converter (ds_to_universal ``extract_zero_shards``) requires of every group; it is dropped on load.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fpscale.parallel.layers import shard, unshard

QUINTIC = (3.4445, -4.7750, 2.0315)
# Attractor recpre/optim/muon_adamw.py POLAR_COEFFS (Polar Express, Amsel et al. 2025): one triple per step
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  coefficients: str = "quintic") -> torch.Tensor:
    """An approximately orthogonal U S' V^T of ``g`` ([..., rows, cols], each matrix on its own),
    computed in ``dtype`` and returned in it. ``quintic``: Keller Jordan's fixed coefficients;
    ``polar_express``: Attractor's per-step ones (at most 5 steps)."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if coefficients == "quintic":
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        triples = [QUINTIC] * steps
    else:
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
        triples = list(POLAR_EXPRESS[:steps])
    for a, b, c in triples:
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.mT if tall else x


def shape_scale(shape, mode: str) -> float:
    """The factor on a matrix's orthogonalised update: ``keller`` max(1, rows/cols)^0.5,
    ``moonlight`` 0.2 sqrt(max(rows, cols)) (the last two dimensions of the WHOLE matrix)."""
    rows, cols = shape[-2], shape[-1]
    if mode == "keller":
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * math.sqrt(max(rows, cols))


class MuonAdamW(torch.optim.Optimizer):
    """Groups carry ``kind``: ``muon`` (lr, weight_decay, momentum, nesterov, ns_steps, ns_dtype,
    ns_coefficients, shape_scale, cautious) or ``adamw`` (lr, weight_decay, betas, eps; torch AdamW's
    update). ``tp_group``: the tensor-parallel group whose slices are gathered. ``layouts`` maps the
    flat partitions DeepSpeed's ZeRO optimizers hand this optimizer to where the matrices lie in them
    (fpscale/train/muon_zero.py). ``skip_next`` skips one step (a non-finite gradient norm)."""

    def __init__(self, groups: list[dict], tp_group=None):
        super().__init__(groups, defaults={})
        self.tp_group = tp_group
        self.layouts: dict[int, object] = {}
        self.skip_next = False

    # -- checkpoints: exp_avg_sq for DeepSpeed's universal converter ---------------------------------
    def state_dict(self):
        sd = super().state_dict()
        for state in sd["state"].values():
            if "exp_avg" in state and "exp_avg_sq" not in state:       # a Muon parameter
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        return sd

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.skip_next:
            self.skip_next = False
            return loss
        for group in self.param_groups:
            (self._muon if group["kind"] == "muon" else self._adamw)(group)
        return loss

    def _adamw(self, group: dict) -> None:
        """torch.optim.AdamW's single-tensor update (torch/optim/adamw.py, decoupled decay)."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = float(state["step"])
            p.mul_(1 - lr * wd)
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))

    def _muon(self, group: dict) -> None:
        beta = group["momentum"]
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)    # every rank joins the gathers
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state.pop("exp_avg_sq", None)          # written for (or loaded from) a universal checkpoint
            state["step"] += 1
            m = state["exp_avg"]
            m.lerp_(grad, 1 - beta)
            u = grad.lerp(m, beta) if group["nesterov"] else m
            layout = self.layouts.get(id(p))
            if layout is None:                     # the parameter itself (one process, ZeRO-0, TP)
                update = self.orthogonalize(u, p, group)
            else:                                  # a flat ZeRO partition
                update = layout.orthogonalize(u, lambda whole, meta: self.orthogonalize(whole, meta, group))
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                if group["cautious"]:
                    p.sub_(p * ((update * p) >= 0), alpha=lr * wd)
                else:
                    p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)

    def orthogonalize(self, u: torch.Tensor, meta, group: dict) -> torch.Tensor:
        """The scaled orthogonalised update of matrix ``u`` (this rank's TP slice of it when ``meta``,
        the parameter, is split: gathered, orthogonalised whole, sliced again), in ``u``'s dtype."""
        split = getattr(meta, "tensor_model_parallel", False) and self.tp_group is not None
        whole = u
        if split:
            world = dist.get_world_size(self.tp_group)
            pieces = [torch.empty_like(u) for _ in range(world)]
            dist.all_gather(pieces, u.contiguous(), group=self.tp_group)
            whole = unshard(pieces, meta.partition_dim, getattr(meta, "tp_parts", 1))
        dtype = DTYPES.get(group["ns_dtype"]) or (torch.bfloat16 if u.is_cuda else torch.float32)    # auto
        out = newton_schulz(whole, group["ns_steps"], dtype, group["ns_coefficients"])
        out = out.to(u.dtype) * shape_scale(whole.shape, group["shape_scale"])
        if split:
            out = shard(out, meta.partition_dim, dist.get_rank(self.tp_group), world, getattr(meta, "tp_parts", 1))
        return out
