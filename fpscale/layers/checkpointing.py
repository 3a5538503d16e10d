"""Selective activation checkpointing of the plain (non-looped) parts of a block: ``model.checkpoint``.

    none    (default) every activation of the block is saved for backward
    mlp     the MLP sublayer x + dropout(MLP(norm(x))) is recomputed in backward: it saves its
            input x only (Megatron's / torchtitan's selective recompute of the SwiGLU MLP)
    block   the whole plain block is recomputed: it saves its input only. A looped layer's solve
            is never run again in backward (its own backward mode, implicit / phantom / jfb /
            unroll, keeps what it needs): ``block`` recomputes the parts outside the solve

Per layer type (what each mode recomputes):
    attn      mlp: the MLP sublayer;  block: the whole block (attention, MLP, norms, dropout)
    fpsa      mlp and block: the MLP sublayer after the solve (the solve keeps its own backward)
    fpmamba   with ``mlp: true``, mlp and block: the MLP sublayer after the solve; without, nothing
    looped    nothing: every sublayer of the core lies inside the solve
    epsilon   nothing: its blocks are the halting loop's map (it unrolls that loop itself)
``model.layers.N.checkpoint`` overrides the global mode for one entry of the stack (all its
``repeat`` copies).

A recomputed region re-enters its modules (their ``__call__``), so ZeRO-3's hooks gather the
parameters again in backward; early stopping of the recomputation is off, so every module's
forward hooks run to their end and every tensor-parallel collective of the region runs again, in
the same order on every rank. ``torch.utils.checkpoint`` restores the default CPU / CUDA random
state for the recomputation; the streams of the tensor-parallel RNG tracker (attention dropout
under TP, fpscale.parallel.random) are restored here: the recomputation draws the masks of the
forward, and the tracker is left where the forward left it.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from fpscale.errors import check

CHECKPOINT_MODES = ("none", "mlp", "block")


def check_mode(value, key: str) -> None:
    check(value in CHECKPOINT_MODES, key, f"must be one of {', '.join(CHECKPOINT_MODES)}, got {value!r}")


def layer_mode(cfg, spec) -> str:
    """The mode of one ``model.layers`` entry: its own ``checkpoint``, else ``model.checkpoint``
    (both checked by ModelConfig.validate, with their keys; again here for configs built in code)."""
    own = getattr(spec, "checkpoint", None)
    if own is not None:
        check_mode(own, f"model.layers.<{spec.type}>.checkpoint")
        return own
    mode = getattr(cfg, "checkpoint", "none")
    check_mode(mode, "model.checkpoint")
    return mode


def applies(cache: dict | None = None) -> bool:
    """Recompute only where there is a backward to save memory for: grad on, no decoding cache
    (a recomputation must not write the cache twice)."""
    return torch.is_grad_enabled() and cache is None


def _trackers(modules: tuple[torch.nn.Module, ...]) -> list:
    """The RNG trackers (fpscale.parallel.random) the modules' tensor-parallel shards draw from."""
    found = {}
    for module in modules:
        for m in module.modules():
            tracker = getattr(getattr(m, "shards", None), "tracker", None)
            if tracker is not None:
                found[id(tracker)] = tracker
    return list(found.values())


def _tracker_contexts(trackers: list):
    """(forward, recompute) contexts for ``checkpoint``'s ``context_fn``: the forward records
    the trackers' streams as it finds them; the recomputation draws from those states and puts
    the streams back where they were before it."""
    recorded: list[dict] = []

    @contextlib.contextmanager
    def forward():
        recorded[:] = [dict(t.states) for t in trackers]
        yield

    @contextlib.contextmanager
    def recompute():
        now = [dict(t.states) for t in trackers]
        for t, states in zip(trackers, recorded):
            t.states = dict(states)
        try:
            yield
        finally:
            for t, states in zip(trackers, now):
                t.states = states

    return forward(), recompute()


def recompute(fn, modules: tuple[torch.nn.Module, ...], *args):
    """``fn(*args)``, its activations recomputed in backward instead of saved (``args`` are kept).
    ``modules``: those ``fn`` calls (where the TP RNG trackers are found)."""
    trackers = _trackers(modules)
    context_fn = (lambda: _tracker_contexts(trackers)) if trackers else None
    kwargs = {"context_fn": context_fn} if context_fn else {}
    return checkpoint(fn, *args, use_reentrant=False, early_stop=False, **kwargs)
