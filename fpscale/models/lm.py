"""The decoder LM: embeddings -> the configured stack of layers -> RMSNorm -> logits.

    model = fpscale.build_model(cfg)          # cfg: fpscale.Config (model + solver sections)
    logits = model(tokens)                    # [B, T] -> [B, T, vocab]
    loss = model.loss(tokens, targets)
    model.solver_stats()                      # {"layers.1.fpsa": SolverStats, ...} of the last forward
    model.layer_stats()                       # the same for every looped layer (epsilon: HaltingStats)
    with model.eval_depth(64): model.eval()(tokens)   # evaluate with up to 64 solver iterations
"""
from __future__ import annotations

import contextlib

import torch

from fpscale.layers.common import RMSNorm
from fpscale.layers.deep_supervision import check_solver, deep_supervised_loss, supervised
from fpscale.layers.fixed_point import FixedPointLayer
from fpscale.layers.looping import LoopedLayer
from fpscale.layers.step_cache import CACHE_MODES
from fpscale.layers.switches import trunc_orthogonal_
from fpscale.models.caps import draw_cap
from fpscale.models.config import ModelConfig
from fpscale.models.heads import LMHead
from fpscale.solvers import SolverConfig, SolverStats


class LoopedLM(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, solver: SolverConfig | None = None, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        solver = solver or SolverConfig()
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.embed_init == "trunc_orthogonal":      # Attractor's (attractor.py:296 with its scaled-zero table)
            trunc_orthogonal_(self.embed.weight, cfg.init_std)
        else:
            torch.nn.init.normal_(self.embed.weight, std=cfg.init_std)
        layers = []
        for i, spec in enumerate(cfg.layers):     # each layer type builds its block (fpscale.layers.registry)
            layer_solver = solver.with_overrides(spec.solver, f"model.layers.{i}.solver") if spec.looped else None
            built = [spec.build(cfg, layer_solver) for _ in range(spec.repeat)]
            if spec.looped and spec.deep_supervision.window > 0:      # fpscale.layers.deep_supervision
                check_solver(layer_solver, f"model.layers.{i}.solver", bool(getattr(spec, "iterate_free", False)))
                for block in built:
                    next(m for m in block.modules() if isinstance(m, FixedPointLayer)).ds_window = \
                        spec.deep_supervision.window
            layers += built
        self.layers = torch.nn.ModuleList(layers)
        for m in self.layers.modules():     # decoding caches preallocated for the longest sequence
            if hasattr(m, "token_capacity"):
                m.token_capacity = cfg.max_seq_len
        # modules that read the token ids of the sequence (value embeddings: fpscale.layers.switches)
        self.token_readers = [m for m in self.layers.modules() if hasattr(m, "tokens")]
        self.layer_types = [spec.type for spec in cfg.expanded_layers()]
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = LMHead()                  # logits and loss; fpscale.parallel swaps in the vocab-parallel one
        self.head.kernel = cfg.loss_kernel    # chunked or liger (fpscale.ops.fused_loss)
        self.lm_head = None
        self.last_losses: dict = {}          # the parts of the last loss (forward with targets)
        if not cfg.tie_embeddings:
            self.lm_head = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.init_std)

    # -- the forward pass -------------------------------------------------------------------
    def hidden(self, tokens: torch.Tensor, caches: list[dict] | None = None, pos: int = 0,
               pad: torch.Tensor | None = None, stop: int | None = None) -> torch.Tensor:
        """The final hidden states (after the last norm); with ``stop``, the input of layer ``stop``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if isinstance(pos, int) and pos + tokens.shape[1] > self.cfg.max_seq_len:    # (a tensor pos: generate checks)
            raise ValueError(f"sequence of {pos + tokens.shape[1]} tokens exceeds model.max_seq_len = "
                             f"{self.cfg.max_seq_len}")
        x = self.embed(tokens)
        for m in self.token_readers:
            m.tokens = tokens
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if pad is not None and (pad.shape != tokens.shape[:1] or pad.dtype != torch.long):
            raise ValueError(f"pad must be a long tensor [batch] = {list(tokens.shape[:1])}, got "
                             f"{pad.dtype} {list(pad.shape)}")
        for i, layer in enumerate(self.layers):
            if i == stop:
                return x
            cache = caches[i] if caches is not None else None
            x = layer(x, pos, cache) if pad is None else layer(x, pos, cache, pad=pad)
        return self.norm(x)

    def hidden_from(self, x: torch.Tensor, start: int, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Layers ``start``, ``start + 1``, ... and the final norm on ``x`` (training: no cache)."""
        for layer in self.layers[start:]:
            x = layer(x, 0, None) if pad is None else layer(x, 0, None, pad=pad)
        return self.norm(x)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head

    def forward(self, tokens: torch.Tensor, caches: list[dict] | None = None, pos: int = 0,
                targets: torch.Tensor | None = None, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; with ``targets``, the loss to minimise instead: the mean
        cross-entropy plus, in training, the looped layers' auxiliary losses (epsilon's halting
        KL). ``last_losses`` keeps both parts of it apart, on the device. With targets no logits
        are made: the cross-entropy is chunked (``head_loss``, ``model.loss_chunk``).

        ``pad`` [B] (long) is each row's left padding, counted in positions from the start of
        the sequence (the same tensor at every decoding step): a padded row computes what the
        row alone computes (positions count from its first real token; padding is never read).
        Every layer type takes it as ``pad`` in its forward."""
        ds = (supervised(self) if targets is not None and self.training and caches is None
                      and torch.is_grad_enabled() else None)
        if ds is not None:      # deep supervision's windows (fpscale.layers.deep_supervision)
            loss, ce, windows_ce, windows = deep_supervised_loss(self, tokens, targets, pad, *ds)
            aux = self.aux_loss()
            self.last_losses = {"ce": ce.detach(), "aux": None if aux is None else aux.detach(),
                                "deep_supervision": windows_ce, "windows": windows}
            return loss if aux is None else loss + aux
        h = self.hidden(tokens, caches, pos, pad)
        if targets is None:
            return self.output(h)
        ce = self.head_loss(h, targets)
        aux = self.aux_loss() if self.training else None
        self.last_losses = {"ce": ce.detach(), "aux": None if aux is None else aux.detach()}
        return ce if aux is None else ce + aux

    def aux_loss(self) -> torch.Tensor | None:
        """The sum of the looped layers' weighted auxiliary losses of the last forward, or None."""
        terms = [m.aux_loss for m in self.looped_layers().values() if m.aux_loss is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h, self.head_weight())

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.head.loss(logits, targets)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the final hidden states ``h`` [B, T, d]: by default chunked,
        ``model.loss_chunk`` tokens at a time without the whole logits (LMHead.chunked_loss; the
        same value and gradients); ``model.loss_chunk: 0`` makes the logits and takes their loss."""
        if self.cfg.loss_chunk > 0:
            return self.head.chunked_loss(h, self.head_weight(), targets, self.cfg.loss_chunk)
        return self.cross_entropy(self.output(h), targets)

    @property
    def sharded_logits(self) -> bool:
        """True under tensor parallelism: each rank's logits are a vocabulary slice."""
        return self.head.sharded_logits

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self(tokens, targets=targets)

    # -- what the trainer and the decoder need ----------------------------------------------
    def looped_layers(self) -> dict[str, LoopedLayer]:
        """Every layer that repeats its map (fixed-point solves and halting loops), by name
        ``layers.{index}.{type}``."""
        return {f"layers.{i}.{self.layer_types[i]}": m for i, layer in enumerate(self.layers)
                for m in layer.modules() if isinstance(m, LoopedLayer)}

    def fixed_point_layers(self) -> dict[str, FixedPointLayer]:
        return {name: m for name, m in self.looped_layers().items() if isinstance(m, FixedPointLayer)}

    def solver_stats(self) -> dict[str, SolverStats]:
        return {name: m.last_stats for name, m in self.fixed_point_layers().items() if m.last_stats is not None}

    def layer_stats(self) -> dict:
        """The last forward's statistics of every looped layer (SolverStats, HaltingStats: each
        has ``to_dict``)."""
        return {name: m.last_stats for name, m in self.looped_layers().items() if m.last_stats is not None}

    def set_step(self, step: int) -> None:
        """Draw this step's randomised caps (the same on every rank) and tell every looped layer
        which optimizer step its forwards belong to (per-step state such as FPSA's power iteration
        advances once per step, however many micro-batches the layout splits it into)."""
        for i, (name, m) in enumerate(self.fixed_point_layers().items()):
            m.cap = draw_cap(self.cfg.iteration_cap, m.solver.max_iter, self.seed, step, i)
        for m in self.looped_layers().values():
            m.optim_step = step

    @contextlib.contextmanager
    def eval_depth(self, depth: int | None):
        """Within the block, every looped layer caps its evaluation at ``depth`` iterations (None:
        each layer's ``solver.forward.eval_max_iter``; a halting layer at most its ``max_steps``). Training
        is unaffected.

            with model.eval_depth(64):
                loss = model(tokens, targets=targets)       # test-time compute: up to 64 iterations
        """
        if depth is not None and depth < 1:
            raise ValueError(f"evaluation depth must be >= 1, got {depth}")
        layers = list(self.looped_layers().values())
        before = [m.eval_depth for m in layers]
        for m in layers:
            m.eval_depth = depth
        try:
            yield self
        finally:
            for m, value in zip(layers, before):
                m.eval_depth = value

    @contextlib.contextmanager
    def decode_cache(self, mode: str | None, compact: bool | None = None):
        """Within the block, cached decoding keeps ``mode``'s cache (``decode.cache``: exact, fixed_point;
        None: as set) and compacts a batch's rows or not (``decode.compact``; None: as set). Start new caches
        when the mode changes (a cache refuses the other mode).

            with model.decode_cache("fixed_point"):
                out = fpscale.generate(model, prompt, 32)
        """
        if mode is not None and mode not in CACHE_MODES:
            raise ValueError(f"decode.cache must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        if compact is not None and not isinstance(compact, bool):
            raise ValueError(f"decode.compact must be true or false, got {compact!r}")
        layers = list(self.looped_layers().values())
        before = [(m.decode_cache, m.decode_compact) for m in layers]
        for m in layers:
            m.decode_cache = mode if mode is not None else m.decode_cache
            m.decode_compact = compact if compact is not None else m.decode_compact
        try:
            yield self
        finally:
            for m, (value, was) in zip(layers, before):
                m.decode_cache, m.decode_compact = value, was

    def new_caches(self, static: bool = False) -> list[dict]:
        """Empty decoding caches, one per layer. ``static``: every shape of a decoding step is the same at every
        position (fpscale.layers.step_cache: attention over the preallocated ``max_seq_len`` under a mask), for a
        step compiled once (``torch.compile(dynamic=False)``, CUDA graphs); pass ``pos`` as a 0-dim long tensor.
        It takes attn and the fixed-point layers in ``decode.cache: fixed_point``."""
        if static:
            for name, m in self.looped_layers().items():
                if not isinstance(m, FixedPointLayer):
                    raise ValueError(f"static decoding caches: {name} is a halting loop, whose cache grows by its "
                                     "halting steps per token; decode it with static=False")
                if m.decode_cache != "fixed_point":
                    raise ValueError(f"static decoding caches need decode.cache: fixed_point, {name} has "
                                     f"{m.decode_cache!r} (exact keeps an entry per iteration, their number changing "
                                     "from token to token)")
        return [{"static": True} if static else {} for _ in self.layers]

    def num_params(self) -> int:
        """Parameter count (also when ZeRO-3 has partitioned the tensors)."""
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())


def build_model(cfg) -> LoopedLM:
    """Build the LM from a full :class:`fpscale.Config` (model + solver) or a ModelConfig."""
    if isinstance(cfg, ModelConfig):
        return LoopedLM(cfg)
    model = LoopedLM(cfg.model, cfg.solver, cfg.seed)
    for m in model.looped_layers().values():
        m.decode_cache, m.decode_compact = cfg.decode.cache, cfg.decode.compact
    return model
