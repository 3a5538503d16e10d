"""The layer types of ``model.layers``, one file each with its spec (config section, block, TP split
rules, FLOPs), and the pieces only layers use (mixers, halting, HQSA, the fixed-point base, activation
checkpointing, deep supervision). Plain PyTorch: no parallelism, no model around them.

A new layer type is one file here plus one registration line below (or ``register_layer(MySpec)``
in a user's own package before its config is loaded: fpscale.layers.registry).
"""
from fpscale.layers.attn import AttnSpec
from fpscale.layers.attractor import AttractorSpec
from fpscale.layers.epsilon import EpsilonSpec
from fpscale.layers.fpmamba import FPMambaSpec
from fpscale.layers.fpmamba2 import FPMamba2Spec
from fpscale.layers.fpsa import FPSASpec
from fpscale.layers.fpsa_lh import FPSALHSpec
from fpscale.layers.looped import LoopedCoreSpec
from fpscale.layers.registry import LAYER_TYPES, FixedPointSpec, LayerSpec, layer_spec, register_layer

# the built-in layer types: one line each
register_layer(AttnSpec)
register_layer(FPSASpec)
register_layer(FPMambaSpec)
register_layer(LoopedCoreSpec)
register_layer(EpsilonSpec)
register_layer(FPMamba2Spec)
register_layer(FPSALHSpec)
register_layer(AttractorSpec)

__all__ = ["LAYER_TYPES", "AttnSpec", "AttractorSpec", "EpsilonSpec", "FPMamba2Spec", "FPMambaSpec", "FPSALHSpec",
           "FPSASpec", "FixedPointSpec", "LayerSpec", "LoopedCoreSpec", "layer_spec", "register_layer"]
