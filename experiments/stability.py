"""Seed 004 (FPRM), Fig. 2b and Proposition 1, on fpscale's looped core.

(a) Activation norm against loop count at initialisation (Fig. 2b): the same randomly initialised
    core weights (tiny_looped's core: 2 blocks = 4 sublayers, d = 128) looped as
      FPRM      z^l = a1 z^{l-1} + b1 f^l(z^{l-1}), z_{i+1}^0 = a2 z_i^L + b2 x   (fpscale's LoopedCore)
      pre-norm  z^l = z^{l-1} + f^l(z^{l-1})           (a Universal Transformer, no scaling)
      post-norm z^l = RMSNorm(z^{l-1} + g^l(z^{l-1}))  (g^l the sublayer without its input norm)
    from the prelude's output x of random tokens; the RMS of the state after each loop, up to 256.
(b) k-step (phantom) gradient error (Proposition 1): train tiny_looped briefly, then at a fixed
    point solved to 1e-6 compare the parameter gradient of k differentiable steps (k = 1..8) with
    the implicit gradient (adjoint solved to 1e-6); the error should fall like sigma^k, sigma the
    contraction factor of the core's Jacobian at z* (estimated by power iteration on J^T).

    PYTHONPATH=. python experiments/stability.py            # full: ~3 min on 2 cores
    PYTHONPATH=. python experiments/stability.py --quick    # seconds: pipeline check
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from experiments.common import QUICK_LM, ROOT, Timer, parse_args, plt, save, table, train_lm  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tiny_looped.yaml")


def core_pieces(model, tokens):
    """(core, x, cos, sin, sublayers): the looped core of tiny_looped, its input and its sublayers
    as functions of z (attention and MLP, each with its own pre-norm)."""
    from fpscale.layers.common import rope_span
    core = model.layers[1]
    x = model.layers[0](model.embed(tokens)).float()
    cos, sin = rope_span(core.head_dim, 0, tokens.shape[1], core.rope_theta, x)
    subs = []
    for l in range(core.blocks):
        subs.append(lambda z, l=l: core.attention(l, z, cos, sin, None)[0])
        subs.append(lambda z, l=l: core.mlp(l, z))
    return core, x, cos, sin, subs


def core_a1(core) -> float:
    return float(torch.sigmoid(core.a1_logit))


def rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


@torch.no_grad()
def norms_at_init(loops: int, seed: int = 0) -> dict:
    import fpscale
    from fpscale.layers.common import rms_norm
    cfg = fpscale.load_config(CONFIG)
    torch.manual_seed(seed)
    model = fpscale.build_model(cfg).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 128), generator=torch.Generator().manual_seed(seed))
    core, x, cos, sin, subs = core_pieces(model, tokens)
    out = {}
    for a1_init in (core_a1(core), 0.5):                   # FPRM: the map fpscale iterates, two inits
        core.a1_logit.fill_(math.log(a1_init / (1 - a1_init)))
        a1, b1, a2, b2 = core.scalings()
        key = f"FPRM (a1 = {float(a1):.2f}, a2 = {float(a2):.2f})"
        out[key] = []
        s = torch.zeros_like(x)
        for _ in range(loops):
            s = core.one_pass(a2 * s + b2 * x, cos, sin, None)
            out[key].append(rms(s))
    out["pre-norm"], out["post-norm"] = [], []
    z = x.clone()
    for _ in range(loops):
        for f in subs:
            z = z + f(z)
        out["pre-norm"].append(rms(z))
    # post-norm: the sublayer without its own input norm (its norm weight is 1 at init: rms_norm of
    # an already normalised z is z), the residual sum normalised
    z = rms_norm(x, None)
    for _ in range(loops):
        for f in subs:
            z = rms_norm(z + f(z), None)
        out["post-norm"].append(rms(z))
    out["input rms"] = rms(x)
    return out


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def gradient_errors(model, tokens, ks) -> dict:
    core = model.layers[1]
    base = dataclasses.replace(core.solver, tol=1e-6, max_iter=400, eval_max_iter=400, stop_quantile=0.0,
                               patience=0, backward_tol=1e-6, backward_max_iter=1000)
    model.train()
    model.set_step(0)
    core.cap = None
    for m in model.fixed_point_layers().values():
        m.cap = None
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def grad_with(**kw):
        core.solver = dataclasses.replace(base, **kw)
        model.zero_grad(set_to_none=True)
        model(inputs, targets=targets).backward()
        return flat_grad(model), core.last_stats

    g_ref, st = grad_with(backward="implicit")
    rows = []
    for k in ks:
        g, _ = grad_with(backward="phantom", phantom_steps=k)
        rows.append({"k": k, "rel_error": float((g - g_ref).norm() / g_ref.norm())})
    # sigma: power iteration on J^T at z* (the spectral radius bounds the asymptotic rate)
    core.solver = base
    _, x, cos, sin, _ = core_pieces(model, inputs)
    a1, b1, a2, b2 = (t.detach() for t in core.scalings())
    with torch.no_grad():
        from fpscale import solve
        z, _ = solve(lambda s: core.one_pass(a2 * s + b2 * x, cos, sin, None), torch.zeros_like(x), base,
                     training=False)
    z = z.detach().requires_grad_()
    fz = core.one_pass(a2 * z + b2 * x.detach(), cos, sin, None)
    v = torch.randn_like(z)
    sig = []
    for _ in range(60):
        v = v / v.norm()
        (w,) = torch.autograd.grad(fz, z, v, retain_graph=True)
        sig.append(float(w.norm()))
        v = w
    return {"rows": rows, "forward_iterations": st.iterations, "adjoint_iterations": st.backward_iterations,
            "adjoint_residual": st.backward_residual, "sigma_power": sig[-1], "sigma_trace": sig}


def main():
    args = parse_args(__doc__)
    loops = 8 if args.quick else 256
    with Timer() as t_init:
        norms = norms_at_init(loops)
    pick = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= loops]
    names = [k for k in norms if k != "input rms"]
    text = table(["loops"] + names, [[n] + [norms[k][n - 1] for k in names] for n in pick],
                 f"RMS of the state after n loops at initialisation (input RMS {norms['input rms']:.4f})")
    steps = 3 if args.quick else 150
    runs = os.path.join(args.out, "runs")
    over = QUICK_LM if args.quick else [f"train.steps={steps}", f"train.eval_interval={steps}", "train.eval_batches=2",
                                        f"train.log_interval={steps // 5}"]
    with Timer() as t_train:
        trained = train_lm("tiny_looped", over, "stability_core", runs, data=args.data)
    import fpscale
    from fpscale.train.checkpoint import load_model
    cfg = fpscale.load_config(CONFIG)
    model, _ = load_model(os.path.join(runs, "stability_core", "final"), cfg=cfg)
    from fpscale.train.build import build_datasets
    cfg.data.path = args.data
    _, val = build_datasets(cfg)
    tokens = val.batch(range(8))[:2, :33] if args.quick else val.batch(range(8))
    ks = list(range(1, 5 if args.quick else 9))
    with Timer() as t_grad:
        ge = gradient_errors(model, tokens, ks)
    errs = [r["rel_error"] for r in ge["rows"]]
    rates = [errs[i + 1] / errs[i] for i in range(len(errs) - 1)]
    fit = math.exp(sum(math.log(r) for r in rates) / len(rates)) if rates else float("nan")
    sigma = ge["sigma_power"]
    text += "\n" + table(["k", "relative error vs implicit", "ratio to k-1", "sigma^k / (1 - sigma)"],
                         [[r["k"], r["rel_error"], (rates[i - 1] if i else float("nan")),
                           sigma ** r["k"] / (1 - sigma) if sigma < 1 else float("nan")]
                          for i, r in enumerate(ge["rows"])],
                         f"k-step gradient error on a core trained {steps} steps (forward {ge['forward_iterations']} "
                         f"iterations, adjoint {ge['adjoint_iterations']}, residual {ge['adjoint_residual']:.1e}); "
                         f"sigma (power iteration on J^T) = {sigma:.3f}, fitted rate = {fit:.3f}")
    print(f"wall: norms {t_init.s:.0f} s, training {t_train.s:.0f} s, gradients {t_grad.s:.0f} s", flush=True)
    fig = plt().figure(figsize=(9, 3.6))
    ax = fig.add_subplot(121)
    for k in names:
        ax.plot(range(1, loops + 1), norms[k], label=k)
    ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel("loops"), ax.set_ylabel("RMS of the state")
    ax.set_title("at initialisation"), ax.legend(fontsize=7)
    ax = fig.add_subplot(122)
    ax.semilogy(ks, errs, marker="o", label="phantom k vs implicit")
    ax.semilogy(ks, [errs[0] * sigma ** (k - 1) for k in ks], ls="--", label=f"sigma^k (sigma={sigma:.2f})")
    ax.set_xlabel("k"), ax.set_ylabel("relative gradient error"), ax.legend(fontsize=7)
    save(args, "stability", {"norms": norms, "gradient": ge, "fitted_rate": fit, "train": {
        k: trained[k] for k in ("val_loss", "val_ppl", "scalings", "wall_s")},
        "wall_s": {"norms": t_init.s, "train": t_train.s, "gradients": t_grad.s}, "table": text}, fig)


if __name__ == "__main__":
    main()
