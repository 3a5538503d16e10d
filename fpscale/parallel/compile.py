"""``train.compile``: torch.compile applied to a built (and parallelized) model, in place.

    auto     (default) by device and model: nothing on CPU (compiling costs minutes there and buys little);
             on CUDA ``model`` when every layer is plain or a one-pass solve (``max_iter`` and
             ``eval_max_iter`` 1: the attn and mamba stacks), else ``blocks`` (a looped layer's solve
             reads its stop decision on the host; its iterations are compiled by the solver itself,
             ``solver.execution.chunk``). The choice is logged
    none     eager
    model    the whole model's forward as one graph (``fullgraph=True``): norms, RoPE, activations,
             residual adds and the loss head fused across blocks. A model that does not trace whole
             says so once (the first reason) and falls back to ``blocks``
    blocks   regional compilation (torchtitan's ``apply_compile``: each block on its own, so one
             compiled graph serves every copy of a block type and the compile time does not grow with
             the depth): every block declares its plain regions (``compile_regions()``, the way it
             declares ``tp_plan()``):
               attn                 the whole block (attention, MLP, norms, dropout, checkpointing)
               fpmamba              the MLP sublayer, the input path before the solve (``mixer.inputs``:
                                    in-projection, causal conv, SiLU) and the gate outside it
                                    (``mixer.gated_output``), each fused by the compiler
               fpsa, fpmamba2       the MLP sublayer after the solve (``mlp_sublayer``); the solve
                                    itself is the solver's (``solver.execution.compile`` compiles its step,
                                    ``solver.execution.chunk`` its iterations: docs/solver.md)
               epsilon              one step of the halting loop (``halting_step``: the block and
                                    its halting head; one graph for every step, the halting update
                                    and the host read between steps outside)
               looped               nothing: every sublayer lies inside the solve
             each region compiled with ``fullgraph=True`` (a graph break is an error, not a slow
             path). A region that cannot compile (a graph break, a backend failure) is named once in
             a warning and runs eager from then on; a call with a decoding cache or a position
             other than 0 (generation) runs eager too (its shapes change every token)
    full     the whole model's forward (``LoopedLM.forward``) as one ``torch.compile`` without
             ``fullgraph``: it breaks the graph where the solver reads its stop decision on the
             host (one break per read per solve: bench/compile_counts.py counts them) and the
             regions between compile. Kept for measurement; ``blocks`` is the mode to train with

Applied by the trainer after ``parallelize`` and before DeepSpeed wraps the model, so the compiled
code sees this rank's shards and the TP collectives (the autograd functions of
fpscale.parallel.mappings). Activation checkpointing (fpscale.layers.checkpointing) lies inside a
compiled block: torch.compile traces ``torch.utils.checkpoint`` as a higher-order op and recomputes
in the compiled backward. ZeRO-3's parameter hooks are ``torch.compiler.disable`` in DeepSpeed
(deepspeed/runtime/zero/parameter_offload.py): a block whose submodules carry them cannot trace as
one graph, so under ``parallel.zero_stage: 3`` every region says so and runs eager.

Parameters and their names are untouched (the compiled function is an instance attribute that
shadows the method): checkpoints, the registry and ZeRO see the same module tree.
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings
from typing import Callable

import torch

from fpscale.errors import check

COMPILE_MODES = ("auto", "none", "model", "blocks", "full")
logger = logging.getLogger("fpscale")


def check_mode(value, key: str = "train.compile") -> None:
    check(value in COMPILE_MODES, key, f"must be one of {', '.join(COMPILE_MODES)}, got {value!r}")


class CompiledRegion:
    """A block's method compiled with ``fullgraph=True``; eager once it failed to compile (said once),
    and for calls that decode (a cache given, or a position other than 0)."""

    def __init__(self, eager: Callable, label: str, backend: str = "inductor"):
        self.eager, self.label = eager, label
        self.is_forward = getattr(eager, "__name__", "") == "forward"
        self.compiled = torch.compile(eager, fullgraph=True, backend=backend)
        self.failed: str | None = None
        self.signature = None if self.is_forward else inspect.signature(eager)
        functools.update_wrapper(self, eager)

    def __call__(self, *args, **kwargs):
        if self.failed is not None or _decoding(self.is_forward, args, kwargs, self.signature) \
                or torch.compiler.is_compiling():
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"train.compile = blocks: {self.label} does not compile ({self.failed}); it runs eager",
                          stacklevel=2)
            return self.eager(*args, **kwargs)


DECODE_ARGS = ("past", "cache", "y_prev")     # a region's arguments that only decoding gives (not None)


def _decoding(is_forward: bool, args, kwargs, signature: inspect.Signature | None = None) -> bool:
    """A block's forward(x, pos, cache, pad) called to decode: a cache, or a position past 0; another
    region (epsilon's halting_step, FP-Mamba's mixer.inputs and mixer.gated_output): one of ``DECODE_ARGS``
    given (epsilon's ``past`` cache entry, the decoding cache, the previous token's output)."""
    if not is_forward:
        if signature is None:
            return kwargs.get("past") is not None
        bound = signature.bind_partial(*args, **kwargs).arguments
        return any(bound.get(name) is not None for name in DECODE_ARGS)
    pos = kwargs.get("pos", args[1] if len(args) > 1 else 0)
    cache = kwargs.get("cache", args[2] if len(args) > 2 else None)
    return cache is not None or (isinstance(pos, int) and pos != 0)


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> list[str]:
    """Compile every plain region of ``model.layers`` in place; returns the regions compiled
    (``layers.0.forward``, ``layers.1.mlp_sublayer``, ...). ``backend``: torch.compile's (tests that
    count graph breaks use aot_eager, which traces forward and backward without Inductor's build)."""
    done = []
    layers: torch.nn.ModuleList = model.layers       # type: ignore[assignment]
    for i, block in enumerate(layers):
        declared = getattr(block, "compile_regions", None)
        regions: tuple[str, ...] = declared() if callable(declared) else ()
        for name in regions:            # a method of the block, or of a submodule ("mixer.inputs")
            label = f"model.layers[{i}] ({type(block).__name__}).{name}"
            *path, attr = name.split(".")
            owner = functools.reduce(getattr, path, block)
            method = getattr(owner, attr)
            if isinstance(method, CompiledRegion):
                continue
            setattr(owner, attr, CompiledRegion(method, label, backend))
            done.append(f"layers.{i}.{name}")
    return done


def one_pass(module: torch.nn.Module) -> bool:
    """True when nothing in ``module`` loops on a host decision: every looped layer in it is a solve of
    one iteration in training and evaluation (125m_mamba, 125m_mamba1) and none is a halting loop."""
    from fpscale.layers.fixed_point import FixedPointLayer
    from fpscale.layers.looping import LoopedLayer
    for m in module.modules():
        if isinstance(m, LoopedLayer):
            solver = getattr(m, "solver", None)
            if not isinstance(m, FixedPointLayer) or solver is None:
                return False
            if solver.max_iter != 1 or solver.eval_max_iter not in (0, 1):
                return False
    return True


def resolve_mode(mode: str, model: torch.nn.Module, device: torch.device | None = None) -> str:
    """``auto`` made concrete for this model on this device (other modes unchanged)."""
    check_mode(mode)
    if mode != "auto":
        return mode
    if device is None:
        device = next(model.parameters()).device
    if device.type != "cuda":
        return "none"
    return "model" if one_pass(model) else "blocks"


class CompiledModel:
    """``LoopedLM.forward`` compiled whole with ``fullgraph=True``; on the first failure to trace, said
    once with its reason, the blocks are compiled one by one instead (``blocks``) and the forward runs
    eager around them. Decoding (a cache, or a position past 0) runs eager."""

    def __init__(self, model: torch.nn.Module, backend: str = "inductor"):
        self.model, self.backend, self.eager = model, backend, model.forward
        self.compiled = torch.compile(self.eager, fullgraph=True, backend=backend)
        self.failed: str | None = None
        functools.update_wrapper(self, self.eager)

    def __call__(self, tokens, caches=None, pos=0, *args, **kwargs):
        if self.failed is not None or caches is not None or (isinstance(pos, int) and pos != 0) \
                or torch.compiler.is_compiling():
            return self.eager(tokens, caches, pos, *args, **kwargs)
        try:
            return self.compiled(tokens, caches, pos, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"train.compile = model: the model does not trace as one graph ({self.failed}); "
                          "compiling its blocks one by one instead (train.compile = blocks)", stacklevel=2)
            torch._dynamo.reset()
            compile_blocks(self.model, self.backend)
            return self.eager(tokens, caches, pos, *args, **kwargs)


def apply_compile(model: torch.nn.Module, mode: str, log: bool = False,
                  backend: str = "inductor", device: torch.device | None = None) -> list[str]:
    """``train.compile`` on a built model (after parallelize, before DeepSpeed): the regions compiled
    (logged with ``log``). ``auto`` is resolved for ``device`` (default: where the parameters are)."""
    chosen = resolve_mode(mode, model, device)
    if chosen == "none":
        done: list[str] = []
    elif chosen == "blocks":
        done = compile_blocks(model, backend)
    elif chosen == "model":
        model.forward = CompiledModel(model, backend)          # type: ignore[method-assign]
        done = ["forward (fullgraph)"]
    else:
        model.forward = torch.compile(model.forward, backend=backend)    # full: breaks at the solver's host reads
        done = ["forward"]
    if log and (chosen != "none" or mode == "auto"):
        what = ", ".join(done) or ("nothing (CPU)" if chosen == "none" else "no plain region in this model")
        logger.info("train.compile = %s%s: %s", mode, f" -> {chosen}" if chosen != mode else "", what)
    return done
