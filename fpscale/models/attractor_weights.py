"""jacobfa/Attractor's weights and config <-> fpscale's, exactly (``launch/convert.py --from attractor``,
``--to attractor``; their format: ``config.json`` = ``asdict(AttractorConfig)`` + ``_class_name`` and
``model.pt`` = the state dict, written by their ``save_pretrained``, attractor/__init__.py:74-93;
``model.safetensors`` with the same names is read too).

Their model -> fpscale's:
  transformer.wte.weight                        embed.weight (tied: their lm_head.weight is the same)
  transformer.prelude.{i}.norm_1 / norm_2       layers.{i}.norm1 / norm2          (backbone ``attn``)
  transformer.prelude.{i}.attn.c_q, c_k, c_v    layers.{i}.attn.w_qkv = [P q; P k; v]
  transformer.prelude.{i}.attn.c_proj           layers.{i}.attn.w_o
  transformer.prelude.{i}.mlp.fc / proj         layers.{i}.mlp.w_fc / w_proj
  transformer.core_block.{j}.*                  layers.{N}.<stacked>[j]           (the ``attractor`` head)
  transformer.ln_f.weight                       norm.weight
P permutes each head's q/k rows from their pair-interleaved RoPE (rotated pairs (2i, 2i+1),
attractor/modules/utils.py:17-29) to fpscale's half-split one (pairs (i, i + dh/2),
fpscale.layers.common.apply_rope); the attention logits q.k are unchanged by it, so the map is exact.
Their ``freqs_cis`` buffer is recomputed from ``rope_settings`` (theta 50,000) and not carried.

The config ``--from attractor`` writes solves as their code does (``decisions: sample, norm: sample_l2,
anderson_variant: attractor``): the function their checkpoint was trained on; settings present as 0
(``backward_min_iter: 0``, ``backward_tol: 0.0``) stay 0 (their config.py:52-55 fills only None), and their
head's optimizer scales (``fp_lr_scale``, ``fp_wd``) become ``train`` groups. ``--to attractor`` takes
that solve or the recipes' causal form of it (configs/*_attractor.yaml: per token, fpscale's Anderson),
with a warning that their code will solve per sample, and writes every ``AttractorConfig`` field: the head's
scales from ``train``, what fpscale's config does not hold (the true vocabulary, attn_impl, ...) from their
config.json as ``--from`` read it (kept as attractor_config.json, fpscale/hf/attractor.py) or their defaults.

Only what fpscale can reproduce converts; anything else is an error naming their key (a softcap, GQA,
value embeddings in the backbone, another MLP or norm, Picard adjoints, the J^T v clip).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import torch

from fpscale.errors import UserError
from fpscale.solvers.config import PART_OF, key_of
from fpscale.typed import nest

SUPPORTED = {"nonlin_name": "ReLU2", "mlp_class_name": "BaseMLP", "norm_class_name": "RMSNorm",
             "block_class_name": "TransformerPreNormBlock", "bias": False, "qk_bias": False, "clip_qkv": None,
             "logit_softcap": None, "mup_model_scaling_factor": 1, "tie_embeddings": True,
             "randomize_positions_from": None}


def rope_perm(head_dim: int) -> torch.Tensor:
    """Rows of one head in fpscale's RoPE layout, as indices into theirs: evens, then odds."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _to_fpscale_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.view(-1, head_dim, w.shape[-1])[:, rope_perm(head_dim)].reshape(w.shape)


def _to_their_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.view(-1, head_dim, w.shape[-1])[:, torch.argsort(rope_perm(head_dim))].reshape(w.shape)


def read_their_folder(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, config dict) of a folder their ``save_pretrained`` wrote."""
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    st, pt = os.path.join(folder, "model.safetensors"), os.path.join(folder, "model.pt")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st), config
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True), config
    raise UserError(f"{folder}: no model.safetensors or model.pt beside config.json (Attractor's save_pretrained)")


def fpscale_config(their: dict[str, Any]) -> dict[str, Any]:
    """fpscale's config (the model with its solver, and the head's ``train`` groups, as YAML data) of their
    ``AttractorConfig`` dict."""
    cls = their.get("_class_name", "AttractorConfig")
    if cls not in ("AttractorConfig", "EQLMConfig") and their.get("model_class_name") != "Attractor":
        raise UserError(f"config.json: _class_name {cls!r} is not an Attractor model")
    for key, want in SUPPORTED.items():
        if key in their and their[key] != want:
            raise UserError(f"config.json: {key} = {their[key]!r} is not supported (fpscale converts {want!r})")
    d, heads = int(their["n_embd"]), int(their["num_attention_heads"])
    if their.get("num_key_value_heads") not in (None, heads):
        raise UserError(f"config.json: num_key_value_heads = {their['num_key_value_heads']} (GQA) is not supported")
    if their.get("solver", "anderson") not in ("anderson", "fpi"):
        raise UserError(f"config.json: solver = {their['solver']!r}: anderson or fpi")
    bw = their.get("backward_type", "onestep")
    if bw not in ("onestep", "anderson") or (bw == "anderson" and their.get("solver") == "fpi"):
        raise UserError(f"config.json: backward_type = {bw!r} with solver {their.get('solver')!r}: fpscale's adjoint "
                        f"iterates as its forward does (onestep, or anderson with an anderson forward)")
    if bw == "onestep" and their.get("adjoint_grad_clip") is not None:
        raise UserError(f"config.json: adjoint_grad_clip = {their['adjoint_grad_clip']} is not supported (null)")
    if their.get("layer_scale_init") is None:
        raise UserError("config.json: layer_scale_init = null (ungated head blocks) is not supported")
    rope = their.get("rope_settings") or {}
    if rope.get("rope_condense_ratio", 1) != 1 or not rope.get("use_rope", True):
        raise UserError(f"config.json: rope_settings {rope} is not supported (use_rope, condense ratio 1)")
    max_iter, tol = int(their.get("max_iter", 12)), float(their.get("tol", 1e-3))
    anderson = their.get("solver", "anderson") == "anderson"
    solver = {"max_iter": max_iter, "min_iter": int(their.get("min_iter", 0)), "tol": tol, "norm": "sample_l2",
              "decisions": "sample",
              "stop_quantile": 0.0, "patience": 0, "eta_min": 0.0, "damping": float(their.get("anderson_beta", 1.0)),
              "anderson": int(their.get("anderson_m", 5)) if anderson else 0,
              "anderson_variant": "attractor" if anderson else "fpscale", "anderson_lambda": 1e-4,
              "backward": "neumann1" if bw == "onestep" else "implicit", "mask_unconverged": False,
              # None means "the forward's" (their config.py:52-55); a present 0 is kept, as their code keeps it
              "backward_max_iter": int(given(their, "backward_max_iter", max_iter)),
              "backward_min_iter": int(given(their, "backward_min_iter", their.get("min_iter", 0))),
              "backward_tol": float(given(their, "backward_tol", tol)), "bookkeeping": "torch"}
    if not anderson:
        solver["damping"] = 1.0
    vocab = int(given(their, "padded_vocab_size", their["vocab_size"]))
    model = {"vocab_size": vocab, "d_model": d, "n_heads": heads, "mlp_ratio": int(their["intermediate_size"]) / d,
             "max_seq_len": int(their.get("block_size", 4096)), "rope_theta": float(rope.get("rope_base", 50_000)),
             "norm_eps": float(their.get("norm_eps", 1e-5)), "init_std": math.sqrt(2 / (5 * d)),
             "embed_init": "trunc_orthogonal",
             "tie_embeddings": True,
             "layers": [{"type": "attn", "repeat": int(their["n_backbone_layers"]), "mlp": "relu2",
                         "qk_norm": bool(their.get("qk_norm", False)), "init": "scaled_zero_ortho"},
                        {"type": "attractor", "head_blocks": int(their.get("n_fp_blocks", 1)),
                         "gate_init": float(their["layer_scale_init"]),
                         "gamma_max": float(their.get("gamma_max") or 1.0), "mlp": "relu2",
                         "qk_norm": bool(their.get("qk_norm", False)),
                         "solver": nest(solver, PART_OF, "solver", warn=False)}]}     # the nested form
    if int(model["mlp_ratio"] * d) != int(their["intermediate_size"]) or int(their["intermediate_size"]) % 16:
        raise UserError(f"config.json: intermediate_size = {their['intermediate_size']} must be a multiple of 16 "
                        f"(fpscale's MLP hidden size)")
    n = int(their["n_backbone_layers"])
    # their optimizer's head settings (fp_lr_scale, fp_wd: config.py:40-41, read by muon_adamw.py
    # get_muon_param_groups): the head in AdamW at lr x fp_lr_scale, its matrices decayed by fp_wd
    scale = float(their.get("fp_lr_scale", 0.75))
    train = {"group_override": {f"layers.{n}.{w}": "matrix" for w in ("w_qkv", "w_o", "w_fc", "w_proj")}
             | {f"layers.{n}.{w}": "other" for w in ("attn_norm", "mlp_norm")},
             "lr_scale": {"matrix": scale, "other": scale},
             "group_weight_decay": {"matrix": float(their.get("fp_wd", 0.0))}}
    return {"model": model, "train": train}


def given(their: dict[str, Any], key: str, default):
    """``their[key]``, or ``default`` where it is absent or null (a present 0 stays 0)."""
    value = their.get(key)
    return default if value is None else value


def to_fpscale(sd: dict[str, torch.Tensor], their: dict[str, Any]) -> dict[str, torch.Tensor]:
    """fpscale's state dict of their state dict (the model of ``fpscale_config(their)``)."""
    d, heads = int(their["n_embd"]), int(their["num_attention_heads"])
    dh, n_bb, n_fp = d // heads, int(their["n_backbone_layers"]), int(their.get("n_fp_blocks", 1))
    sd = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in sd.items()}
    used = {"freqs_cis", "lm_head.weight"}
    out = {"embed.weight": sd["transformer.wte.weight"], "norm.weight": sd["transformer.ln_f.weight"]}
    used |= {"transformer.wte.weight", "transformer.ln_f.weight"}

    def block(prefix: str) -> dict[str, torch.Tensor]:
        names = ["norm_1.weight", "attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight",
                 "norm_2.weight", "mlp.fc.weight", "mlp.proj.weight"]
        missing = [prefix + n for n in names if prefix + n not in sd]
        if missing:
            raise UserError(f"their state dict lacks {', '.join(missing)}")
        used.update(prefix + n for n in names)
        t = {n: sd[prefix + n] for n in names}
        qkv = torch.cat([_to_fpscale_rows(t["attn.c_q.weight"], dh), _to_fpscale_rows(t["attn.c_k.weight"], dh),
                         t["attn.c_v.weight"]])
        return {"norm1": t["norm_1.weight"], "qkv": qkv, "o": t["attn.c_proj.weight"], "norm2": t["norm_2.weight"],
                "fc": t["mlp.fc.weight"], "proj": t["mlp.proj.weight"]}

    for i in range(n_bb):
        b = block(f"transformer.prelude.{i}.")
        out.update({f"layers.{i}.norm1.weight": b["norm1"], f"layers.{i}.attn.w_qkv": b["qkv"],
                    f"layers.{i}.attn.w_o": b["o"], f"layers.{i}.norm2.weight": b["norm2"],
                    f"layers.{i}.mlp.w_fc": b["fc"], f"layers.{i}.mlp.w_proj": b["proj"]})
    heads_ = [block(f"transformer.core_block.{j}.") for j in range(n_fp)]
    gates = {}
    for g in ("raw_gamma_attn", "raw_gamma_mlp"):
        gates[g] = torch.stack([sd[f"transformer.core_block.{j}.{g}"] for j in range(n_fp)])
        used.update(f"transformer.core_block.{j}.{g}" for j in range(n_fp))
    h = f"layers.{n_bb}."
    for ours, theirs_ in (("attn_norm", "norm1"), ("w_qkv", "qkv"), ("w_o", "o"), ("mlp_norm", "norm2"),
                          ("w_fc", "fc"), ("w_proj", "proj")):
        out[h + ours] = torch.stack([b[theirs_] for b in heads_])
    out.update({h + g: t for g, t in gates.items()})
    left = sorted(set(sd) - used)
    if left:
        raise UserError(f"their state dict has weights fpscale's attractor does not hold: {', '.join(left[:5])}")
    return {k: v.contiguous() for k, v in out.items()}


def gpt_to_fpscale(sd: dict[str, torch.Tensor], n_layer: int, heads: int) -> dict[str, torch.Tensor]:
    """fpscale's state dict of their GPT baseline's (attractor/models/gpt/gpt.py): attn layers, with
    ``value_embed`` where they have a table (``value_embeds.{i}`` -> ``layers.{i}.attn.value_embed.table``,
    ``transformer.h.{i}.attn.ve_gate`` -> ``.gate``). Their untied ``lm_head`` is unused with tied embeddings
    (gpt.py:129-130) and not carried."""
    d = sd["transformer.wte.weight"].shape[1]
    dh = d // heads
    out = {"embed.weight": sd["transformer.wte.weight"], "norm.weight": sd["transformer.ln_f.weight"]}
    for i in range(n_layer):
        t = f"transformer.h.{i}."
        q, k = (_to_fpscale_rows(sd[t + f"attn.c_{n}.weight"], dh) for n in ("q", "k"))
        out.update({f"layers.{i}.norm1.weight": sd[t + "norm_1.weight"],
                    f"layers.{i}.attn.w_qkv": torch.cat([q, k, sd[t + "attn.c_v.weight"]]),
                    f"layers.{i}.attn.w_o": sd[t + "attn.c_proj.weight"],
                    f"layers.{i}.norm2.weight": sd[t + "norm_2.weight"],
                    f"layers.{i}.mlp.w_fc": sd[t + "mlp.fc.weight"],
                    f"layers.{i}.mlp.w_proj": sd[t + "mlp.proj.weight"]})
        if f"value_embeds.{i}.weight" in sd:
            out[f"layers.{i}.attn.value_embed.table"] = sd[f"value_embeds.{i}.weight"]
            out[f"layers.{i}.attn.value_embed.gate"] = sd[t + "attn.ve_gate.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_theirs(sd: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Their state dict of fpscale's (a model built from ``fpscale_config``: attn layers, then one attractor)."""
    dh = model_cfg.d_model // model_cfg.n_heads
    specs = model_cfg.expanded_layers()
    if specs[-1].type != "attractor" or any(s.type != "attn" for s in specs[:-1]):
        raise UserError("--to attractor: the model must be attn layers followed by one attractor layer")
    n_bb = len(specs) - 1
    out = {"transformer.wte.weight": sd["embed.weight"], "lm_head.weight": sd["embed.weight"],
           "transformer.ln_f.weight": sd["norm.weight"]}

    def put(prefix, norm1, qkv, o, norm2, fc, proj):
        q, k, v = qkv.chunk(3)
        out.update({prefix + "norm_1.weight": norm1, prefix + "attn.c_q.weight": _to_their_rows(q, dh),
                    prefix + "attn.c_k.weight": _to_their_rows(k, dh), prefix + "attn.c_v.weight": v,
                    prefix + "attn.c_proj.weight": o, prefix + "norm_2.weight": norm2,
                    prefix + "mlp.fc.weight": fc, prefix + "mlp.proj.weight": proj})

    for i in range(n_bb):
        p = f"layers.{i}."
        put(f"transformer.prelude.{i}.", sd[p + "norm1.weight"], sd[p + "attn.w_qkv"], sd[p + "attn.w_o"],
            sd[p + "norm2.weight"], sd[p + "mlp.w_fc"], sd[p + "mlp.w_proj"])
    h = f"layers.{n_bb}."
    for j in range(specs[-1].head_blocks):
        put(f"transformer.core_block.{j}.", *(sd[h + n][j] for n in ("attn_norm", "w_qkv", "w_o", "mlp_norm",
                                                                       "w_fc", "w_proj")))
        for g in ("raw_gamma_attn", "raw_gamma_mlp"):
            out[f"transformer.core_block.{j}.{g}"] = sd[h + g][j]
    return {k: v.contiguous() for k, v in out.items()}


# every field of their AttractorConfig as their save_pretrained writes it (asdict after __post_init__), with
# the defaults of attractor/models/config.py:20-72 and attractor/models/attractor/config.py:11-44 for what
# fpscale does not hold: ``--to attractor`` writes them unless ``base`` (the config.json ``--from attractor``
# read, kept beside the converted weights as attractor_config.json) gives them
THEIR_DEFAULTS: dict[str, Any] = {
    "name": "", "hf_config": {}, "padding_multiple": 512, "use_abacus": False, "randomize_positions_from": None,
    "attn_impl": "flash", "qk_bias": False, "skip_initialization": False, "mup_model_scaling_factor": 1,
    "use_fused_head": "pytorch", "debias_attention": False, "center_attention": False, "clip_qkv": None,
    "causal": True, "activation_checkpoint_impl": "per-block", "simple_ops": False, "strategy": "single"}


def their_config(cfg, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Their ``config.json`` (every ``AttractorConfig`` field + ``_class_name``) of an fpscale Config whose
    model is attn layers then one attractor layer with their solver (``fpscale_config``'s form): the head's
    optimizer scales from ``train`` (fp_lr_scale = lr_scale.matrix, fp_wd = group_weight_decay.matrix); the
    fields fpscale does not hold (the true vocabulary, attn_impl, ...) from ``base`` where given."""
    m = cfg.model
    specs = m.expanded_layers()
    head = specs[-1]
    s = cfg.solver.with_overrides(head.solver, f"model.layers.{len(m.layers) - 1}.solver")
    # their solve, or the recipes' causal form of it (configs/*_attractor.yaml: per token, fpscale's Anderson)
    solves = {("sample_l2", "sample", "attractor"): "theirs", ("l2", "token", "fpscale"): "causal"}
    variant = s.anderson_variant if s.anderson else {"sample": "attractor", "token": "fpscale"}[s.decisions]
    solve = solves.get((s.norm, s.decisions, variant))
    if solve is None:
        raise UserError(f"--to attractor: solver norm / decisions / anderson_variant = {s.norm} / {s.decisions} / "
                        f"{s.anderson_variant}: Attractor's solve is sample_l2 / sample / attractor, the recipes' "
                        f"causal form of it l2 / token / fpscale")
    if solve == "causal":
        warnings.warn("--to attractor: this model solved per token (decisions: token, the causal recipes); their "
                      "code solves per sample with its own Anderson, which is not causal before convergence: its "
                      "logits equal fpscale's where both solves converge (docs/attractor.md)", stacklevel=2)
    for key, want in (("stop_quantile", 0.0), ("patience", 0), ("anderson_lambda", 1e-4)):
        if getattr(s, key) != want:
            raise UserError(f"--to attractor: {key_of(key, 'solver')} = {getattr(s, key)!r}: Attractor's solver has "
                            f"{want!r}")
    if s.backward not in ("neumann1", "implicit") or (s.backward == "implicit" and not s.anderson):
        raise UserError(f"--to attractor: solver.adjoint.backward = {s.backward}: neumann1, or implicit with Anderson")
    base = base or {}
    kept = {k: base.get(k, v) for k, v in THEIR_DEFAULTS.items()}
    true_vocab = base.get("vocab_size", m.vocab_size)
    if base.get("padded_vocab_size", m.vocab_size) != m.vocab_size:
        true_vocab = m.vocab_size           # another vocabulary than the one base describes
    theta = int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta
    t = cfg.train
    return {**kept, "_class_name": "AttractorConfig", "model_class_name": "Attractor",
            "name": base.get("name", cfg.name),
            "block_size": m.max_seq_len, "vocab_size": true_vocab, "padded_vocab_size": m.vocab_size,
            "n_embd": m.d_model, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads,
            "intermediate_size": int(m.mlp_ratio * m.d_model), "bias": False, "tie_embeddings": True,
            "block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm", "norm_eps": m.norm_eps,
            "mlp_class_name": "BaseMLP", "nonlin_name": "ReLU2", "qk_norm": bool(head.qk_norm), "logit_softcap": None,
            "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": theta},
            "n_backbone_layers": len(specs) - 1, "n_fp_blocks": head.head_blocks,
            "solver": "anderson" if s.anderson else "fpi", "max_iter": s.max_iter, "min_iter": s.min_iter,
            "tol": s.tol, "anderson_m": s.anderson or 5, "anderson_beta": s.damping,
            "backward_type": "onestep" if s.backward == "neumann1" else "anderson",
            "backward_max_iter": s.backward_max_iter, "backward_min_iter": s.backward_min_iter,
            "backward_tol": s.backward_tol, "adjoint_grad_clip": None, "layer_scale_init": head.gate_init,
            "gamma_max": head.gamma_max, "init_strategy": "scaled-zero", "init_orthogonal": True,
            "fp_lr_scale": t.lr_scale.get("matrix", 1.0), "fp_wd": t.group_weight_decay.get("matrix", 0.0),
            "recurrent_embedding_dimension": m.d_model}

