"""Fixtures of jacobfa/Attractor's model (fcf045f, run unmodified) with present-but-zero adjoint settings,
for tests/models/test_attractor_zeros.py (the converter keeps ``backward_min_iter: 0`` and ``backward_tol: 0.0``).

    .venv/bin/python scripts/peer_fixtures/make_attractor_zero_fixtures.py --attractor /path/to/jacobfa/Attractor

imports their ``attractor`` package from the folder given (never from fpscale or /work/shared) and writes
tests/fixtures/attractor_zeros.safetensors. The model is tests/fixtures/README.md's attractor_parity one (vocab 32,
d 16, 2 heads, MLP 64, 1 backbone block, a head of 2 weight-tied blocks, QK-norm, their scaled-zero orthogonal
init, layer_scale_init 0.1, ``attn_impl: sdpa`` on a CPU), run in float64 with their Anderson adjoint
(``backward_type: anderson``), min_iter 8, in two cases: ``min0`` (backward_min_iter 0, backward_tol 1e-3: their
adjoint stops before 8) and ``tol0`` (backward_min_iter 0, backward_tol 0.0, backward_max_iter 12: it runs to its
cap). The same weights in both (stored once, ``weight.``). What is changed around their code (nothing
inside it): their module-level ``anderson_solve`` as attractor.py calls it for the adjoint (attractor.py:79) is
wrapped to copy the info it returns; the forward's info is their ``_last_solver_info``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "attractor_zeros.safetensors")
BASE = dict(name="zeros", vocab_size=32, n_embd=16, num_attention_heads=2, intermediate_size=64, block_size=64,
            n_backbone_layers=1, n_fp_blocks=2, norm_class_name="RMSNorm", nonlin_name="ReLU2", qk_norm=True,
            attn_impl="sdpa", init_strategy="scaled-zero", init_orthogonal=True, layer_scale_init=0.1, gamma_max=0.75,
            solver="anderson", anderson_m=5, anderson_beta=1.0, tol=1.5e-4, max_iter=40, min_iter=8,
            backward_type="anderson",
            adjoint_grad_clip=None, fp_lr_scale=0.5, fp_wd=0.1)
CASES = {"min0": dict(backward_min_iter=0, backward_tol=1e-3, backward_max_iter=40),
         "tol0": dict(backward_min_iter=0, backward_tol=0.0, backward_max_iter=12)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attractor", required=True, help="a checkout of jacobfa/Attractor (fcf045f)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    sys.path.insert(0, args.attractor)
    import attractor.models.attractor.attractor as their_model
    from attractor.models.attractor.config import AttractorConfig
    adjoint = {}
    solve = their_model.anderson_solve

    def recording(*a, **k):
        u, info = solve(*a, **k)
        adjoint.update(iters=int(info["iters"]) if "iters" in info else info.get("n_iter"),
                       info={k2: (v.tolist() if torch.is_tensor(v) else v) for k2, v in info.items()})
        return u, info

    their_model.anderson_solve = recording
    tensors, meta = {}, {}
    for case, settings in CASES.items():
        cfg = AttractorConfig(**BASE, **settings)
        torch.manual_seed(1234)
        model = cfg.construct_model().double()
        with torch.no_grad():            # tests/fixtures/README.md: every weight matters
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight") or name.endswith("mlp.proj.weight"):
                    p.normal_(0, 0.5 * (2 / (5 * 16)) ** 0.5)
                elif "raw_gamma" in name:
                    p.add_(0.3 * torch.randn_like(p))
                elif "norm" in name or "ln_f" in name:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
        ids, labels = torch.randint(0, 32, (3, 8)), torch.randint(0, 32, (3, 8))
        model.train()
        adjoint.clear()
        out = model(ids, labels=labels, return_logits=True)
        out["loss"].backward()
        tensors["input_ids"], tensors["labels"] = ids, labels
        tensors[f"{case}.loss"] = out["loss"].detach().double().reshape(1)
        for name, p in model.named_parameters():
            if f"weight.{name}" in tensors:
                assert torch.equal(tensors[f"weight.{name}"], p.detach()), name
            tensors[f"weight.{name}"] = p.detach().clone()
            if p.grad is not None:
                tensors[f"{case}.grad.{name}"] = p.grad.detach().clone()
        info = model._last_solver_info
        meta[case] = {"config": asdict(cfg) | {"_class_name": "AttractorConfig"},
                      "forward": {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in info.items()},
                      "adjoint": dict(adjoint)}
    meta["script"] = "scripts/peer_fixtures/make_attractor_zero_fixtures.py; jacobfa/Attractor fcf045f"
    meta["torch"] = torch.__version__
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.out, metadata={"meta": json.dumps(meta)})
    print(json.dumps({c: (meta[c]["forward"].get("iters"), meta[c]["adjoint"].get("iters")) for c in CASES}))


if __name__ == "__main__":
    main()
