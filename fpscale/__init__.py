"""fpscale: distributed pretraining of looped (fixed-point) language models.

Importing fpscale points ``TORCH_EXTENSIONS_DIR`` (unless set) into this Python environment
(``sys.prefix``/torch_extensions, where it is writable): DeepSpeed JIT-builds its ops (the CPU
communication op) there, so two environments on one machine never rebuild each other's
(torch's default, ~/.cache/torch_extensions, is shared by all of them).
"""
import os as _os
import sys as _sys

if "TORCH_EXTENSIONS_DIR" not in _os.environ and _os.access(_sys.prefix, _os.W_OK):
    _os.environ["TORCH_EXTENSIONS_DIR"] = _os.path.join(_sys.prefix, "torch_extensions")

from fpscale.config import Config, load_config  # noqa: E402
from fpscale.errors import ConfigError  # noqa: E402
from fpscale.models import build_model, generate  # noqa: E402
from fpscale.solvers import SolverConfig, solve  # noqa: E402

__all__ = ["Config", "ConfigError", "SolverConfig", "build_model", "generate", "load_config", "solve"]
__version__ = "0.1.0"
