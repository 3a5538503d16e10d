"""Decoding: greedy or sampled, with caches (only new tokens are iterated) or without.

    out = fpscale.generate(model, prompt, max_new_tokens=32)                   # greedy, cached
    out, logits = fpscale.generate(model, prompt, 32, use_cache=False, return_logits=True)
    out = fpscale.generate(model, prompts, 32, pad=pad)    # a batch of left-padded prompts

``pad`` [B] counts each prompt's left padding (the rows of a batch of prompts of different
lengths are right-aligned); every row then decodes as it would alone. ``cache`` is ``decode.cache``
(exact, fixed_point: docs/decoding.md; None: the model's, set from the config by build_model);
``stats``, a list, receives one dict per forward (the prompt's, then one per new token): each looped
layer's solver iterations in it, so a token that converged early shows what it saved, and in its ``rows``
the rows f computed in that solve's loop, summed over its iterations (batch x iterations, less where the
batch's done rows left the solve: ``compact``, ``decode.compact``, fpscale.solvers.rows; None: as set):

    steps = []
    out = fpscale.generate(model, prompt, 32, cache="fixed_point", stats=steps)
    [s["layers.3.core"] for s in steps[1:]]          # iterations per new token of one layer
    [s.rows["layers.3.core"] for s in steps[1:]]     # the rows f computed per new token of one layer

``static`` (``decode.cache: fixed_point``): static caches (``LoopedLM.new_caches(static=True)``) and the position
as a tensor, so every decoding step has the same shapes and a compiled forward is built once:

    model.forward = torch.compile(model.forward, dynamic=False)
    out = fpscale.generate(model, prompt, 32, cache="fixed_point", static=True)
"""
from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             use_cache: bool = True, top_k: int | None = None, generator: torch.Generator | None = None,
             return_logits: bool = False, pad: torch.Tensor | None = None, cache: str | None = None,
             stats: list | None = None, compact: bool | None = None, static: bool = False):
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if getattr(model, "sharded_logits", False):
        raise ValueError("this model's logits are split over tensor-parallel ranks; decode with a "
                         "single-process model (parallel.tp = 1)")
    if static and not use_cache:
        raise ValueError("static=True decodes with caches: use_cache must be True")
    if static and tokens.shape[1] + max_new_tokens - 1 > model.cfg.max_seq_len:
        raise ValueError(f"sequence of {tokens.shape[1] + max_new_tokens - 1} tokens exceeds model.max_seq_len = "
                         f"{model.cfg.max_seq_len} (a static cache holds max_seq_len tokens)")
    was_training = model.training
    model.eval()
    with model.decode_cache(cache, compact):
        try:
            return _decode(model, tokens, max_new_tokens, temperature, use_cache, top_k, generator, return_logits,
                           pad, stats, static)
        finally:
            model.train(was_training)


def _decode(model, tokens, max_new_tokens, temperature, use_cache, top_k, generator, return_logits, pad, stats,
            static):
    def forward(*args, **kwargs):
        out = model(*args, **kwargs)[:, -1]
        if stats is not None:
            stats.append(StepStats(model.solver_stats()))
        return out

    def position(n: int):        # a static step's position is data (a tensor), not a constant a graph guards on
        return torch.tensor(n, device=tokens.device) if static else n

    caches = model.new_caches(static=static) if use_cache else None
    logits = forward(tokens, caches=caches, pos=position(0), pad=pad)
    steps = []
    for i in range(max_new_tokens):
        steps.append(logits)
        if temperature == 0.0:
            nxt = logits.argmax(-1)
        else:
            scaled = logits.float() / temperature
            if top_k is not None:
                kth = scaled.topk(top_k, -1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            nxt = torch.multinomial(scaled.softmax(-1), 1, generator=generator)[:, 0]
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        if i == max_new_tokens - 1:
            break
        if use_cache:
            logits = forward(tokens[:, -1:], caches=caches, pos=position(tokens.shape[1] - 1), pad=pad)
        else:
            logits = forward(tokens, pad=pad)
    return (tokens, torch.stack(steps, 1) if steps else logits[:, :0]) if return_logits else tokens


class StepStats(dict):
    """One forward's statistics: {layer: solver iterations}, and ``rows`` {layer: rows f computed in the loop}."""

    def __init__(self, solver_stats: dict):
        super().__init__({name: st.iterations for name, st in solver_stats.items()})
        self.rows = {name: st.row_iterations for name, st in solver_stats.items()}
