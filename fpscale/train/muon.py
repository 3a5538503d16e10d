"""MuonAdamW: Muon for the blocks' weight matrices, AdamW for everything else, in one torch optimizer
that is correct on every layout fpscale runs (one process, tensor parallel, ZeRO 0-3, bf16).

Muon (Keller Jordan, github.com/KellerJordan/Muon muon.py ``muon_update``): SGD momentum (Nesterov by
default, momentum 0.95), the update orthogonalised by Newton-Schulz, scaled by the matrix's shape:

    m <- beta m + (1 - beta) g                  (``m.lerp_(g, 1 - beta)``, kept as state ``exp_avg``)
    u <- (1 - beta) g + beta m  (Nesterov)  or  m
    O <- NS5(u)  ~  U S' V^T  with  u = U S V^T
    O <- NorMuon(O)                             (``normuon``: below)
    p <- p - lr * wd * d * p * mask - lr * scale(shape) * O

``scale``: ``keller`` max(1, rows / cols)^0.5 (muon.py; Attractor multiplies its Muon lr by the same,
jacobfa/Attractor recpre/optim/muon_adamw.py:82 ``group['lr'] * max(1.0, shape[-2] / shape[-1]) ** 0.5``),
or ``moonlight`` 0.2 * sqrt(max(rows, cols)) (Moonlight, Liu et al. 2025: matches AdamW's update RMS so
Muon can share AdamW's learning rate).
``d`` (``wd_scale``): ``lr`` 1 (Keller's ``p.mul_(1 - lr * wd)``), or ``step`` scale(shape): the decay
scaled like the step, as Attractor's, whose lr carries the shape scale (muon_adamw.py:47
``p.sub_(lr_f * g + lr_f * wd_f * p * mask)``). ``mask``: all ones (decoupled weight decay), or with
``cautious`` the elements where update and weight agree in sign, ``(O * p) >= 0`` (muon_adamw.py:46).
``normuon`` (Attractor's MuonAdamW, muon_adamw.py:37-44, NorMuon): a second moment ``v`` per row of
the orthogonalised update (per column of a wide matrix), ``v <- lerp(v, mean(O^2), 1 - beta2)`` with
no bias correction, and O <- O / sqrt(v), rescaled to O's Frobenius norm, in float32 (float64 stays).
``split_fused`` (the default): a fused projection (q/k/v stacked in ``w_qkv``, FP-Mamba's ``w_in``: the
parts a layer's ``tp_plan`` declares) is orthogonalised part by part, each with its own shape scale and
NorMuon moment, as Keller's records and Attractor do with separate c_q, c_k, c_v; off, the fused
matrix is one matrix (Megatron's default).

Newton-Schulz: the quintic X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315),
5 steps in bf16 after normalising by the Frobenius norm (muon.py ``zeropower_via_newtonschulz5``; on a CPU,
where bf16 matmuls are slower than fp32 ones, ``ns_dtype: auto`` runs them in fp32), or
Attractor's ``polar_express`` coefficients (one triple per step, normalised by 1.02 x the norm). The
quintic is not exact: it maximises the slope at zero, so the singular values land in about [0.7, 1.2]
rather than at 1 (muon.py's docstring: "S'_ii ~ Uniform(0.5, 1.5)"); tests/train/test_muon.py
compares it with U V^T on that band.

Layouts. The update of a matrix depends on the whole matrix, so wherever a rank holds a piece:
  tensor parallel   the rank's slice is all-gathered over the TP group along its split dimension
                    (``unshard``, fused q/k/v split part by part), orthogonalised whole (part by part
                    with ``split_fused``; NorMuon's moment is kept for the whole matrix), and the rank
                    keeps its slice (Megatron's TensorParallelMuon "gather" mode; every TP rank does the
                    same Newton-Schulz: a distributed Newton-Schulz would split that work, bench/optimizer.py
                    measures what the gather costs).
  ZeRO 1/2, bf16    DeepSpeed hands the optimizer a flat fp32 partition of each parameter group, which
                    cuts matrices anywhere; fpscale/train/muon_zero.py tells this optimizer where each
                    matrix lies in it: the Nesterov update (elementwise, on the partition) is all-gathered
                    over the DP group, each matrix touching this partition is orthogonalised whole, and
                    the rank keeps its part. Momentum stays partitioned (ZeRO's saving kept).
  ZeRO 3            the same, with ZeRO-3's per-parameter partitions.
                    NorMuon's moment belongs to whole matrices: a flat partition keeps, as state
                    ``normuon_v`` (1-D), the moments of every matrix it touches, the same on each
                    rank that touches one (each computes the same whole update). Resumable on the
                    same layout; DeepSpeed's universal converter does not know it.
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
    computed in ``dtype`` and returned in it, in the reference's own order of operations (bitwise equal
    to it in bf16: tests/train/test_muon_peers.py). ``quintic``: Keller Jordan's fixed coefficients
    (muon.py ``zeropower_via_newtonschulz5``: a tall matrix transposed, ``B = b A + c A @ A`` with
    (c A) @ A); ``polar_express``: Attractor's per-step ones, at most 5 (muon_adamw.py:26-35: a tall
    matrix kept, A = X^T X and X <- a X + X (b A + c (A A)))."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if coefficients == "quintic":
        a, b, c = QUINTIC
        if tall:
            x = x.mT
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(steps):
            A = x @ x.mT
            B = b * A + c * A @ A
            x = a * x + B @ x
        return x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS[:steps]:
        if tall:
            A = x.mT @ x
            x = a * x + x @ (b * A + c * (A @ A))
        else:
            A = x @ x.mT
            x = a * x + (b * A + c * (A @ A)) @ x
    return x


def shape_scale(shape, mode: str) -> float:
    """The factor on a matrix's orthogonalised update: ``keller`` max(1, rows/cols)^0.5,
    ``moonlight`` 0.2 sqrt(max(rows, cols)) (the last two dimensions of the WHOLE matrix)."""
    rows, cols = shape[-2], shape[-1]
    if mode == "keller":
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * math.sqrt(max(rows, cols))


def normuon(o: torch.Tensor, v: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon's row normalisation of the orthogonalised update ``o`` ([..., rows, cols]) with its second
    moment ``v`` ([..., rows, 1], or [..., 1, cols] for a wide matrix; updated in place), in at least
    float32, the operations of Attractor's muon_step (recpre/optim/muon_adamw.py:37-44)."""
    rd = -1 if o.size(-2) >= o.size(-1) else -2
    g = o.to(torch.promote_types(o.dtype, torch.float32))
    v_mean = g.square().mean(dim=rd, keepdim=True)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * g.size(rd)).sqrt()
    v.lerp_(v_mean.to(v.dtype), 1 - beta2)
    scale = v.clamp_min(1e-10).rsqrt()
    v_new = ((v_mean * g.size(rd)) * scale.to(g.dtype).square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return o * (scale * (v_norm / v_new.clamp_min(1e-10))).to(o.dtype)


def moment_shape(shape) -> tuple:
    """The shape of NorMuon's moment of a matrix of ``shape``: one per row, or per column if wide."""
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], rows, 1) if rows >= cols else (*shape[:-2], 1, cols)


def fused_parts(meta) -> tuple[int, int]:
    """(dim, parts) of a fused projection: the equal sub-matrices a layer's ``tp_plan`` declares
    (``mark_fused``; under TP the ``partition_dim`` / ``tp_parts`` marks); (0, 1) for a plain matrix."""
    if getattr(meta, "fused", None):
        return meta.fused
    parts = getattr(meta, "tp_parts", 1)
    return (meta.partition_dim, parts) if parts > 1 else (0, 1)


class MuonAdamW(torch.optim.Optimizer):
    """Groups carry ``kind``: ``muon`` (lr, weight_decay, momentum, nesterov, ns_steps, ns_dtype,
    ns_coefficients, shape_scale, cautious, normuon, normuon_beta2, wd_scale, split_fused) or ``adamw``
    (lr, weight_decay, betas, eps; torch AdamW's update). ``tp_group``: the tensor-parallel group whose
    slices are gathered. ``layouts`` maps the flat partitions DeepSpeed's ZeRO optimizers hand this
    optimizer to where the matrices lie in them (fpscale/train/muon_zero.py). ``skip_next`` skips one
    step (a non-finite gradient norm)."""

    def __init__(self, groups: list[dict], tp_group=None):
        for g in groups:
            if g.get("kind") == "muon":
                for key, value in self.MUON_DEFAULTS.items():
                    g.setdefault(key, value)
                g.setdefault("base_weight_decay", g.get("weight_decay", 0.0))
        super().__init__(groups, defaults={})
        self.tp_group = tp_group
        self.layouts: dict[int, object] = {}
        self.skip_next = False
        self._decay: dict[int, object] = {}     # wd_scale step: a parameter's decay scale (float or map)

    MUON_DEFAULTS = {"normuon": False, "normuon_beta2": 0.95, "wd_scale": "lr", "split_fused": True}

    # -- checkpoints: exp_avg_sq for DeepSpeed's universal converter ---------------------------------
    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for g in self.param_groups:         # a checkpoint written before a group had these keys
            if g.get("kind") == "muon":
                for key, value in self.MUON_DEFAULTS.items():
                    g.setdefault(key, value)
                g.setdefault("base_weight_decay", g["weight_decay"])

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
                if group["normuon"] and "normuon_v" not in state:
                    state["normuon_v"] = self.new_moment([(p, p.shape)], group, p)
                moment = state["normuon_v"] if group["normuon"] else None
                update = self.orthogonalize(u, p, group, moment)
            else:                                  # a flat ZeRO partition
                pieces = layout.touching()
                if group["normuon"] and "normuon_v" not in state:
                    state["normuon_v"] = self.new_moment([(q.param, q.shape) for q in pieces], group, p)
                moments = self.split_moment(state.get("normuon_v"), [(q.param, q.shape) for q in pieces], group)
                update = layout.orthogonalize(
                    u, lambda whole, meta, k: self.orthogonalize(whole, meta, group, moments[k]))
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                d = self.decay_scale(p, group, layout)
                if group["cautious"] or isinstance(d, torch.Tensor):
                    decay = p * ((update * p) >= 0) if group["cautious"] else p
                    if isinstance(d, torch.Tensor):
                        decay, d = decay * d, 1.0
                    p.sub_(decay, alpha=lr * wd * d)
                else:
                    p.mul_(1 - lr * wd * d)                  # Keller's order
            p.add_(update, alpha=-lr)

    def decay_scale(self, p: torch.Tensor, group: dict, layout) -> float | torch.Tensor:
        """The factor on this parameter's decay (``wd_scale``): 1, or its (parts') shape scale; on a
        flat partition a map of each element's matrix's (``FlatLayout.fill``), computed once."""
        if group["wd_scale"] != "step":
            return 1.0
        key = id(p)
        if key not in self._decay:
            def part_scale(meta, shape) -> float:
                whole = self.whole_shape(meta, shape)
                dim, parts = fused_parts(meta) if group["split_fused"] else (0, 1)
                part = list(whole)
                part[dim] //= parts
                return shape_scale(part, group["shape_scale"])
            self._decay[key] = part_scale(p, p.shape) if layout is None else \
                layout.fill(lambda piece: part_scale(piece.param, piece.shape)).to(p.dtype)
        return self._decay[key]

    def moment_numels(self, meta, shape, group: dict) -> list[int]:
        """The sizes of NorMuon's moments of the matrix ``meta`` (TP-local ``shape``), part by part."""
        whole = list(self.whole_shape(meta, shape))
        dim, parts = fused_parts(meta) if group["split_fused"] else (0, 1)
        whole[dim] //= parts
        return [math.prod(moment_shape(whole))] * parts

    def new_moment(self, matrices: list, group: dict, like: torch.Tensor) -> torch.Tensor:
        """Zero NorMuon moments of ``matrices`` [(meta, shape)], flat and concatenated, in at least float32."""
        n = sum(sum(self.moment_numels(m, s, group)) for m, s in matrices)
        return torch.zeros(n, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)

    def split_moment(self, flat, matrices: list, group: dict) -> list:
        """``flat`` (``new_moment``'s) cut into each matrix's moment (views); Nones without NorMuon."""
        if flat is None:
            return [None] * len(matrices)
        return list(flat.split([sum(self.moment_numels(m, s, group)) for m, s in matrices]))

    def whole_shape(self, meta, shape) -> tuple:
        """The shape of the whole matrix of which ``meta`` (a parameter of ``shape``) is a TP slice."""
        out = list(shape)
        if getattr(meta, "tensor_model_parallel", False) and self.tp_group is not None:
            out[meta.partition_dim] *= dist.get_world_size(self.tp_group)
        return tuple(out)

    def orthogonalize(self, u: torch.Tensor, meta, group: dict, moment: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled orthogonalised update of matrix ``u`` (this rank's TP slice of it when ``meta``,
        the parameter, is split: gathered, orthogonalised whole, sliced again), in ``u``'s dtype; a fused
        matrix part by part with ``split_fused``; ``moment``: its NorMuon moments (flat, updated)."""
        split = getattr(meta, "tensor_model_parallel", False) and self.tp_group is not None
        whole = u
        if split:
            world = dist.get_world_size(self.tp_group)
            pieces = [torch.empty_like(u) for _ in range(world)]
            dist.all_gather(pieces, u.contiguous(), group=self.tp_group)
            whole = unshard(pieces, meta.partition_dim, getattr(meta, "tp_parts", 1))
        dtype = DTYPES.get(group["ns_dtype"]) or (torch.bfloat16 if u.is_cuda else torch.float32)    # auto
        dim, parts = fused_parts(meta) if group["split_fused"] else (0, 1)
        chunks = whole.chunk(parts, dim) if parts > 1 else [whole]
        moments = None
        if group["normuon"]:
            moments = [v.view(moment_shape(c.shape)) for v, c in zip(moment.chunk(parts), chunks)]
        outs = []
        for i, c in enumerate(chunks):
            o = newton_schulz(c, group["ns_steps"], dtype, group["ns_coefficients"])
            if moments is not None:
                o = normuon(o, moments[i], group["normuon_beta2"])
            outs.append(o.to(u.dtype) * shape_scale(c.shape, group["shape_scale"]))
        out = torch.cat(outs, dim) if parts > 1 else outs[0]
        if split:
            out = shard(out, meta.partition_dim, dist.get_rank(self.tp_group), world, getattr(meta, "tp_parts", 1))
        return out
