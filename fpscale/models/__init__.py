"""The LM around the layers: its config, ``build_model``, the heads, generation. Plain PyTorch, no
parallelism (fpscale.parallel.parallelize splits a built model). The layer types are fpscale.layers,
the kernels fpscale.ops; their old paths under fpscale.models still import (fpscale.models.moved)."""
from fpscale.layers.registry import LAYER_TYPES, FixedPointSpec, LayerSpec, layer_spec, register_layer
from fpscale.models import moved
from fpscale.models.config import IterationCap, ModelConfig
from fpscale.models.generate import generate
from fpscale.models.lm import LoopedLM, build_model

moved.install()

__all__ = ["IterationCap", "FixedPointSpec", "LAYER_TYPES", "LayerSpec", "ModelConfig", "LoopedLM", "build_model",
           "generate", "layer_spec", "register_layer"]
