"""What a fixed-point map computed in a given dtype can resolve, and the tolerance it can reach.

fpscale's precision policy for looped layers (README, "Precision"):
  * the solver keeps the iterate, the residuals, the damping and Anderson's mixing in float32
    (float64 stays float64), whatever dtype the map computes in;
  * the map keeps the iterate and every elementwise operation on it (residual mixing, the
    channel mixer, norms, the SSM decay and scan) in float32, and runs the heavy products
    (linear layers, attention) in the model's dtype: bf16 under DeepSpeed's bf16 mode or
    autocast;
  * a bf16 product still rounds its output to 8 significant bits, so the relative residual of
    such a map stops falling at a floor of a few times bf16's unit roundoff (2^-8). A tolerance
    below the floor of the dtype the map runs in cannot be reached: every solve would run to its
    cap. ``resolvable_tol`` raises it to the floor (``fpscale.Config`` does so at load time with
    a warning naming the key; ``solve`` does it for any caller, with one warning per value).
"""
from __future__ import annotations

import warnings

import torch

# The smallest relative residual (inf norm per token) that a map computing its products in this
# dtype reaches reliably. bf16 / fp16: measured on the tiny configs under the policy above
# (README, "Precision"); float32 and float64: far below any tolerance a user sets.
RESIDUAL_FLOOR = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 0.0, torch.float64: 0.0}


def map_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype a map's products run in: autocast's when it is on for the device, else ``like``'s."""
    kind = like.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return like.dtype


def residual_floor(dtype: torch.dtype) -> float:
    return RESIDUAL_FLOOR.get(dtype, 0.0)


_warned: set = set()


def resolvable_tol(tol: float, dtype: torch.dtype, what: str = "tol") -> float:
    """``tol`` raised to the floor of ``dtype``, warning once per (what, tol, dtype)."""
    floor = residual_floor(dtype)
    if tol >= floor:
        return tol
    if (what, tol, dtype) not in _warned:
        _warned.add((what, tol, dtype))
        warnings.warn(f"solver {what} = {tol:g} is below what a map computed in {str(dtype).replace('torch.', '')} "
                      f"can resolve (relative residual floor {floor:.3g}): using {floor:.3g}", stacklevel=3)
    return floor
