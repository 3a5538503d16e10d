"""The fixed-point solver shared by every looped layer type. It knows nothing of models."""
from fpscale.solvers.config import SolverConfig
from fpscale.solvers.iterate import Consensus, token_residual
from fpscale.solvers.solve import solve
from fpscale.solvers.stats import SolverStats

__all__ = ["solve", "SolverConfig", "SolverStats", "Consensus", "token_residual"]
