"""fpscale: distributed pretraining of looped (fixed-point) language models."""
from fpscale.config import Config, load_config
from fpscale.errors import ConfigError
from fpscale.models import build_model, generate
from fpscale.solvers import SolverConfig, solve

__all__ = ["Config", "ConfigError", "SolverConfig", "build_model", "generate", "load_config", "solve"]
__version__ = "0.1.0"
