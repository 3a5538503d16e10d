"""FpscaleConfig: what a Hugging Face folder of an fpscale model records (fpscale.hf).

``fpscale_model`` and ``fpscale_solver`` are fpscale's ``model`` and ``solver`` config sections
as plain dicts; the evaluation depth is chosen at load time:

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, eval_depth=8)
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, layer_eval_depth={"1": 16})

eval_depth         at most this many iterations for every looped layer at evaluation (None: each
                   layer's own ``solver.forward.eval_max_iter``; an epsilon layer at most its max_steps)
layer_eval_depth   per layer, by index in the expanded stack, over ``eval_depth``: a dict, or the
                   string "1:16;3:4" (lm-evaluation-harness's --model_args cannot hold a dict)
decode_cache       ``decode.cache``: exact (the default) or fixed_point, what generate()'s cache keeps of
                   the looped layers' past (docs/decoding.md); read at every forward, like the depths
decode_compact     ``decode.compact``: a batch's rows whose tokens are done leave the solve (both cache modes)
                   (True, the default) or run to the slowest row's last iteration (False)
"""
from __future__ import annotations

from transformers import PretrainedConfig


def parse_layer_depths(value) -> dict[str, int]:
    """{"layer index": depth} from a dict or "i:d;j:e"; a depth must be a positive integer."""
    if value is None or value == "":
        return {}
    items = value.items() if isinstance(value, dict) else (
        part.split(":", 1) for part in str(value).replace(",", ";").split(";") if part.strip())
    out = {}
    for key, depth in items:
        try:
            layer, depth = int(str(key).strip()), int(str(depth).strip())
        except ValueError:
            raise ValueError(f"layer_eval_depth: expected 'layer:depth' pairs of integers, got {value!r}") from None
        if layer < 0 or depth < 1:
            raise ValueError(f"layer_eval_depth: layer {layer} depth {depth}: need layer >= 0 and depth >= 1")
        out[str(layer)] = depth
    return out


def check_depth(value) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"eval_depth must be a positive integer or None, got {value!r}")
    return int(value)


def eval_depths(config) -> tuple[int | None, dict[str, int]]:
    """(eval_depth, {layer: depth}) of ``config``, checked: from_pretrained(..., key=value) sets
    the attributes after __init__, and a user may set them on a loaded model."""
    return check_depth(config.eval_depth), parse_layer_depths(config.layer_eval_depth)


class FpscaleConfig(PretrainedConfig):
    model_type = "fpscale"

    def __init__(self, fpscale_model: dict | None = None, fpscale_solver: dict | None = None,
                 eval_depth: int | None = None, layer_eval_depth=None, decode_cache: str = "exact",
                 decode_compact: bool = True, **kwargs):
        self.fpscale_model = dict(fpscale_model or {})
        self.fpscale_solver = dict(fpscale_solver or {})
        self.eval_depth = check_depth(eval_depth)
        self.layer_eval_depth = parse_layer_depths(layer_eval_depth)
        self.decode_cache = decode_cache
        self.decode_compact = decode_compact
        m = self.fpscale_model
        # the fields transformers and lm-evaluation-harness read (sequence length, sizes, tokens)
        self.vocab_size = kwargs.pop("vocab_size", m.get("vocab_size"))
        self.hidden_size = kwargs.pop("hidden_size", m.get("d_model"))
        self.num_attention_heads = kwargs.pop("num_attention_heads", m.get("n_heads"))
        self.max_position_embeddings = kwargs.pop("max_position_embeddings", m.get("max_seq_len"))
        self.bos_token_id = kwargs.pop("bos_token_id", 1)
        self.eos_token_id = kwargs.pop("eos_token_id", 2)
        self.pad_token_id = kwargs.pop("pad_token_id", 2)
        self.use_cache = kwargs.pop("use_cache", True)
        kwargs["tie_word_embeddings"] = False      # LoopedLM ties its head itself (no separate weight)
        super().__init__(**kwargs)
