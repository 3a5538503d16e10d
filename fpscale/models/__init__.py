"""Plain-PyTorch looped LMs: attn, fpsa, fpmamba and looped layers. No parallelism here."""
from fpscale.models.config import IterationCap, LayerSpec, ModelConfig
from fpscale.models.generate import generate
from fpscale.models.lm import LoopedLM, build_model

__all__ = ["IterationCap", "LayerSpec", "ModelConfig", "LoopedLM", "build_model", "generate"]
