"""Fixtures of the references' own optimizers, run unmodified, for tests/train/test_muon_peers.py.

    .venv/bin/python scripts/peer_fixtures/make_muon_fixtures.py \
        --attractor /path/to/jacobfa/Attractor --keller /path/to/KellerJordan/Muon

imports ``recpre/optim/muon_adamw.py`` (jacobfa/Attractor at fcf045f) and ``muon.py`` (KellerJordan/Muon)
from the folders given (never from fpscale or /work/shared) and writes tests/fixtures/muon_peers/*.safetensors.
What is changed AROUND their code (nothing inside it):
  * TORCHDYNAMO_DISABLE=1 (set here before torch is imported): Attractor's ``adamw_step`` / ``muon_step`` are
    ``@torch.compile(fullgraph=True)``; they run eagerly, the same operations in the same order.
  * float64 runs: ``torch.Tensor.bfloat16`` is replaced by ``.double()`` while their optimizers step (both
    cast the update to bf16 for Newton-Schulz: muon_adamw.py:26, muon.py:17), so the whole step is the
    float64 algorithm. The bf16 fixtures (``ns_bf16``) run with torch untouched.
  * Keller's ``MuonWithAuxAdam`` is distributed: it runs in a one-process gloo group (world size 1).
  * Attractor's trainer (scripts/train.py:689-710) is replayed by ``attractor_schedule`` below: per step,
    group lr = the scheduled lr (8e-3 x factor) x base_lr (their trapezoid: constant, then linear to 0
    over the last cooldown fraction, recpre/schedulers ``trapezoid``, scripts/train.py:1182-1195), Muon weight decay
    muon_wd x (1 - step / max_steps), momentum 0.85 -> 0.95 over 300 steps; optimizer steps 1..10 (their
    trainer skips the step at optimizer_step 0, scripts/train.py:713: fpscale does not; the fixture starts
    from step 1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "muon_peers")
STEPS, MAX_STEPS, COOLDOWN = 10, 12, 0.5
D, HEADS, FF, VOCAB = 16, 2, 64, 32


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Float64Bf16:
    """``Tensor.bfloat16`` as ``.double()`` while inside (their float64 runs)."""

    def __enter__(self):
        self.saved = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda t, *a, **k: t.double()

    def __exit__(self, *exc):
        torch.Tensor.bfloat16 = self.saved


def attractor_params(gen) -> dict[str, torch.nn.Parameter]:
    """Their 140m model's parameter kinds at d 16 (names and tags of attractor/models/attractor/attractor.py:
    one backbone block, one head block tagged _fp_head with fp_lr_scale 0.5, fp_wd 0.1, lines 263-270)."""
    shapes = {"transformer.wte.weight": (VOCAB, D), "transformer.ln_f.weight": (D,)}
    for prefix in ("transformer.prelude.0.", "transformer.core_block.0."):
        shapes.update({prefix + "norm_1.weight": (D,), prefix + "attn.c_q.weight": (D, D),
                       prefix + "attn.c_k.weight": (D, D), prefix + "attn.c_v.weight": (D, D),
                       prefix + "attn.c_proj.weight": (D, D), prefix + "norm_2.weight": (D,),
                       prefix + "mlp.fc.weight": (FF, D), prefix + "mlp.proj.weight": (D, FF)})
    shapes.update({"transformer.core_block.0.raw_gamma_attn": (D,), "transformer.core_block.0.raw_gamma_mlp": (D,)})
    params = {}
    for name, shape in shapes.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3)
        if "raw_gamma" in name:
            p._no_weight_decay = True
        if name.startswith("transformer.core_block."):
            p._fp_head, p._fp_lr_scale = True, 0.5
            if p.ndim >= 2:
                p._fp_force_wd = 0.1
            else:
                p._no_muon_wd = True
        params[name] = p
    return params


def attractor_schedule(step: int) -> tuple[float, float, float]:
    """(lr factor, muon wd, momentum) their trainer sets before optimizer step ``step`` (module docstring)."""
    cooldown = int(COOLDOWN * MAX_STEPS)
    lr = 1.0 if step <= MAX_STEPS - cooldown else max((MAX_STEPS - step) / cooldown, 0.0)
    return lr, 0.2 * (1 - step / MAX_STEPS), 0.85 + min(step / 300, 1.0) * (0.95 - 0.85)


def run_attractor(repo: str) -> dict[str, torch.Tensor]:
    their = load(os.path.join(repo, "recpre/optim/muon_adamw.py"), "attractor_muon_adamw")
    gen = torch.Generator().manual_seed(48)
    params = attractor_params(gen)
    out = {f"init/{n}": p.detach().clone() for n, p in params.items()}
    # their launch_configs/attractor-small-140m.yaml optim_config, through recpre/optim/__init__.py:19-30
    groups = their.get_muon_param_groups(list(params.items()), adamw_lr=8e-3, adamw_betas=(0.8, 0.95),
                                         adamw_eps=1e-10, adamw_wd=0.0, muon_lr=8e-3, muon_momentum=0.95,
                                         muon_wd=0.2, muon_ns_steps=5)
    opt = their.MuonAdamW(groups)
    lrs = []
    for step in range(1, STEPS + 1):
        factor, wd, momentum = attractor_schedule(step)
        for g in opt.param_groups:                       # scripts/train.py:691-710
            g["lr"] = torch.as_tensor(factor * 8e-3 * g["base_lr"])     # their scheduler's lr: optim_config lr
            if g["kind"] == "muon" and not g.get("pin_wd", False):
                g["weight_decay"] = max(0.0, wd)
            if g["kind"] == "muon":
                g["momentum"] = momentum
        lrs.append(factor)
        for n, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float32).double()
            out[f"grad{step}/{n}"] = p.grad.float().clone()
        with Float64Bf16():
            opt.step()
    out.update({f"final/{n}": p.detach().clone() for n, p in params.items()})
    out["lr_factor"] = torch.tensor(lrs, dtype=torch.float64)
    return out


def run_keller(repo: str) -> dict[str, torch.Tensor]:
    keller = load(os.path.join(repo, "muon.py"), "keller_muon")
    gen = torch.Generator().manual_seed(7)
    shapes = {"square": (16, 16), "tall": (48, 16), "wide": (16, 40), "embed": (32, 16), "gain": (16,)}
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3)
              for n, s in shapes.items()}
    out = {f"init/{n}": p.detach().clone() for n, p in params.items()}
    muon = [params[n] for n in ("square", "tall", "wide")]
    opt = keller.MuonWithAuxAdam([
        dict(params=muon, lr=0.02, momentum=0.95, weight_decay=0.1, use_muon=True),
        dict(params=[params["embed"], params["gain"]], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01,
             use_muon=False)])
    for step in range(1, STEPS + 1):
        for n, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float32).double()
            out[f"grad{step}/{n}"] = p.grad.float().clone()
        with Float64Bf16():
            opt.step()
    out.update({f"final/{n}": p.detach().clone() for n, p in params.items()})
    return out


def run_ns_bf16(attractor_repo: str, keller_repo: str) -> dict[str, torch.Tensor]:
    """Their orthogonalisations in bf16, torch untouched: Keller's quintic (zeropower_via_newtonschulz5) and
    Attractor's muon_step with momentum 0, lr 1, weight decay 0 and a zero weight, which leaves the weight
    at minus its polar-express update after NorMuon (a fresh moment, beta2 0.95)."""
    keller = load(os.path.join(keller_repo, "muon.py"), "keller_muon")
    their = load(os.path.join(attractor_repo, "recpre/optim/muon_adamw.py"), "attractor_muon_adamw")
    gen = torch.Generator().manual_seed(3)
    out = {}
    for name, shape in (("tall", (48, 16)), ("wide", (16, 40)), ("square", (32, 32))):
        g = torch.randn(shape, generator=gen, dtype=torch.float32)
        out[f"input/{name}"] = g
        out[f"quintic/{name}"] = keller.zeropower_via_newtonschulz5(g.clone(), steps=5)
        rd = -1 if shape[-2] >= shape[-1] else -2
        vshape = (1, shape[0], 1) if rd == -1 else (1, 1, shape[1])
        p, m, v = torch.zeros(1, *shape), torch.zeros(1, *shape), torch.zeros(vshape)
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        their.muon_step(g.clone()[None], p, m, v, f32(0.0), f32(1.0), f32(0.0), f32(0.95), 5, rd)
        out[f"polar_normuon/{name}"] = -p[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attractor", required=True, help="a checkout of jacobfa/Attractor (fcf045f)")
    ap.add_argument("--keller", required=True, help="a checkout of KellerJordan/Muon")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29581", rank=0, world_size=1)
    meta = {"script": "scripts/peer_fixtures/make_muon_fixtures.py", "attractor": "jacobfa/Attractor fcf045f",
            "keller": "KellerJordan/Muon", "torch": torch.__version__}
    save_file(run_attractor(args.attractor), os.path.join(args.out, "attractor_muon_adamw.safetensors"),
              metadata={k: str(v) for k, v in meta.items()})
    save_file(run_keller(args.keller), os.path.join(args.out, "keller_muon.safetensors"),
              metadata={k: str(v) for k, v in meta.items()})
    save_file(run_ns_bf16(args.attractor, args.keller), os.path.join(args.out, "ns_bf16.safetensors"),
              metadata={k: str(v) for k, v in meta.items()})
    dist.destroy_process_group()
    print(json.dumps(meta), file=sys.stderr)


if __name__ == "__main__":
    main()
