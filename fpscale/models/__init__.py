"""Plain-PyTorch looped LMs: attn, fpsa, fpmamba and looped layers (fpscale.models.registry:
a layer type is one file plus one registration line). No parallelism here."""
from fpscale.models.config import IterationCap, ModelConfig
from fpscale.models.generate import generate
from fpscale.models.lm import LoopedLM, build_model
from fpscale.models.registry import LAYER_TYPES, FixedPointSpec, LayerSpec, layer_spec, register_layer

__all__ = ["IterationCap", "FixedPointSpec", "LAYER_TYPES", "LayerSpec", "ModelConfig", "LoopedLM", "build_model",
           "generate", "layer_spec", "register_layer"]
