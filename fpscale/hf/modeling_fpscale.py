"""FpscaleForCausalLM: an fpscale LoopedLM behind the transformers interface.

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, eval_depth=8)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    batch = tok(["a prompt", "another, longer prompt"], return_tensors="pt", padding=True)   # left padding
    out = model.generate(**batch, max_new_tokens=20, do_sample=False)

The model is fpscale's own code (bundled beside this file by fpscale.hf.export), so its logits
are fpscale's. What transformers needs on top:
  cache           FpscaleCache: fpscale's per-layer decoding caches (K/V of attention and FPSA,
                  the scan state of FP-Mamba, HQSA's running sums, one entry per epsilon step)
                  and how many tokens they hold; generate() passes it from step to step
  attention mask  left padding only (zeros, then ones, per row): it becomes LoopedLM's ``pad``,
                  under which a padded row computes what the row alone computes. A mask with a
                  0 after a 1 (right padding, holes) is refused: a looped layer's solve would read it
  depth           config.eval_depth / config.layer_eval_depth cap the looped layers' iterations
                  at evaluation; they are read at every forward, so they may change after loading
  decode cache    config.decode_cache (``decode.cache``: exact, fixed_point; docs/decoding.md), read
                  at every forward as the depths (a cache refuses the other mode: set it between generations)
Training through this wrapper (labels give the shifted cross-entropy) is possible but fpscale's
own trainer is the supported way; the layers' solvers run as in fpscale (eval: tolerance, depth).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from fpscale.hf.configuration_fpscale import FpscaleConfig, eval_depths
from fpscale.layers.step_cache import CACHE_MODES, TokenBuffer
from fpscale.models.config import ModelConfig
from fpscale.models.lm import LoopedLM
from fpscale.solvers import SolverConfig
from fpscale.typed import from_dict


class FpscaleCache:
    """fpscale's decoding caches of every layer, and how many tokens they cover."""

    is_compileable = False

    def __init__(self, layers: list[dict]):
        self.layers = layers
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows ``beam_idx`` of every cached tensor (all are batch-first)."""
        def pick(obj):
            if isinstance(obj, TokenBuffer):        # a preallocated token axis (fpscale.layers.step_cache)
                return obj.index_select(0, beam_idx.to(obj.data.device))
            if isinstance(obj, torch.Tensor):
                return obj.index_select(0, beam_idx.to(obj.device))
            if isinstance(obj, dict):
                return {k: pick(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [pick(v) for v in obj]
            return obj
        self.layers = pick(self.layers)


def left_padding(mask: torch.Tensor, length: int) -> torch.Tensor | None:
    """LoopedLM's ``pad`` ([B] long) from an attention mask [B, length] of left padding; None when
    no row is padded."""
    if mask.dim() != 2 or mask.shape[1] != length:
        raise ValueError(f"attention_mask must be [batch, {length}] (past and new tokens), got {list(mask.shape)}")
    ones = mask.to(torch.bool)
    if (ones[:, :-1] & ~ones[:, 1:]).any():
        raise ValueError("fpscale models take left padding only (per row: zeros, then ones); this attention_mask "
                         "has a 0 after a 1. Pad on the left (tokenizer.padding_side = 'left')")
    pad = (~ones).sum(1)
    return pad if bool(pad.any()) else None


class FpscalePreTrainedModel(PreTrainedModel):
    config_class = FpscaleConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _is_stateful = True          # a recurrent state (scans, halting sums): no cache cropping

    def _init_weights(self, module):
        """The weights come from the fpscale checkpoint; LoopedLM initialises itself."""


class FpscaleForCausalLM(FpscalePreTrainedModel, GenerationMixin):
    def __init__(self, config: FpscaleConfig):
        super().__init__(config)
        model_cfg = from_dict(ModelConfig, config.fpscale_model, "model")
        model_cfg.validate()
        self.model = LoopedLM(model_cfg, from_dict(SolverConfig, config.fpscale_solver, "solver"))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False             # the cache is fpscale's (FpscaleCache), made by forward

    def get_input_embeddings(self):
        return self.model.embed

    def apply_eval_depth(self) -> None:
        """Set every looped layer's evaluation cap (per layer over the global one), decoding cache mode
        (``decode_cache``) and row compaction (``decode_compact``) from the config."""
        depth, per_layer = eval_depths(self.config)
        mode = getattr(self.config, "decode_cache", "exact")
        if mode not in CACHE_MODES:
            raise ValueError(f"decode_cache must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        compact = getattr(self.config, "decode_compact", True)
        if not isinstance(compact, bool):
            raise ValueError(f"decode_compact must be true or false, got {compact!r}")
        for name, layer in self.model.looped_layers().items():
            layer.eval_depth = per_layer.get(name.split(".")[1], depth)
            layer.decode_cache, layer.decode_compact = mode, compact

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                past_key_values: FpscaleCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if past_key_values is not None and not isinstance(past_key_values, FpscaleCache):
            raise ValueError(f"past_key_values must be the FpscaleCache this model returned, got "
                             f"{type(past_key_values).__name__}")
        cache = past_key_values if past_key_values is not None else (
            FpscaleCache(self.model.new_caches()) if use_cache else None)
        pos = cache.seen if cache is not None else 0
        pad = None if attention_mask is None else left_padding(attention_mask, pos + input_ids.shape[1])
        self.apply_eval_depth()
        logits = self.model(input_ids, caches=cache.layers if cache is not None else None, pos=pos, pad=pad)
        if cache is not None:
            cache.seen += input_ids.shape[1]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None,
                                      **kwargs):
        """Only the tokens the cache has not seen; the mask always covers the whole sequence."""
        if past_key_values is not None and past_key_values.seen:
            input_ids = input_ids[:, past_key_values.seen:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                "use_cache": use_cache}
