"""Parallelism, kept out of the model code: process groups and the DeepSpeed model-parallel unit."""
from fpscale.parallel.state import ParallelState, init_parallel

__all__ = ["ParallelState", "init_parallel"]
