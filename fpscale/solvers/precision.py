"""What a fixed-point map computed in a given dtype can resolve, and the tolerance it can reach.

fpscale's precision policy for looped layers (docs/solver.md, "Precision"):
  * the solver keeps the iterate, the residuals, the damping and Anderson's mixing in float32
    (float64 stays float64), whatever dtype the map computes in;
  * the map keeps the iterate and every elementwise operation on it (residual mixing, the
    channel mixer, norms, the SSM decay and scan) in float32, and runs the heavy products
    (linear layers, attention) in the model's dtype: bf16 under DeepSpeed's bf16 mode or
    autocast;
  * the map's output is still rounded to its dtype, so the relative residual (inf norm per
    token) stops falling near one unit in the last place of the largest element, the dtype's
    machine epsilon (bf16 2^-7 = 7.8e-3, fp16 2^-10, fp32 1.2e-7), and reaches two of them
    reliably: the floor is 2 eps (bf16 0.0156, fp32 2.4e-7). Measured on the tiny configs
    after 100 training steps, with tol = 0 for 40 iterations, the largest per-sample residual a
    solve ever reached was 6.8e-3 (fpsa), 2.7e-3 (looped), 5.1e-4 (fpmamba) in bf16 (weights
    cast or autocast alike), and 1.6e-7 to 1.4e-6 in fp32; per iteration the bf16 maximum over
    the batch sits at exactly 2^-7 for fpsa. The adjoint of implicit backward (fp32 state, bf16
    vector-Jacobian products) reached 5e-4 after 30 iterations on the same fpsa weights. At
    initialisation the looped core under autocast plateaus just above 1e-2 (1.3 eps) for some
    samples: a tolerance between 1 and 2 eps is reached by most solves, not by all.
    A float32 map on CUDA with TF32 matmuls on (an fp32 run: fpscale.train.precision) has its
    products' inputs rounded to TF32's 10 mantissa bits: by the same argument its floor is 2 TF32
    eps (2^-9 = 1.95e-3; taken from bf16's measurement by analogy, not measured on a GPU here).
    A tolerance below the floor of the dtype the map runs in cannot be reached: every solve
    would run to its cap. ``resolvable_tol`` raises it to the floor (``fpscale.Config`` does so
    at load time with a warning naming the key; ``solve`` does it for any caller, with one
    warning per value).
  * ``norm: sample_l2`` (jacobfa/Attractor's residual: ||f(z) - z||_2 / ||z||_2 over a whole sample, in
    float32) averages the rounding over every element of the sample instead of taking the worst one,
    and a map whose iterate is carried in float32 around bf16 branches (Attractor's gated head) rounds
    only the branches: its floor is far below 2 eps. Measured with bench/sample_l2_floor.py (the
    ``attractor`` layer of configs/tiny_attractor.yaml, tol 0 for 40 iterations, the largest residual
    over the batch each iteration, at initialisation): the lowest residual of the slowest sample,
      gate 0.1, d 64, T 64, B 4:    bf16 weights 2.08e-3, autocast 1.99e-3   (fp32 5.8e-7)
      gate 0.1, d 128, T 128, B 4:  bf16 2.77e-3 (2 seeds), autocast 2.63e-3 (fp32 1.4e-5, still falling)
      gate 0.25, d 64, T 64, B 4:   bf16 3.98e-3, autocast 4.28e-3           (fp32 8.2e-4, still falling)
    i.e. 0.25-0.55 bf16 eps, growing with the gates' share of the iterate (what is rounded). The floor
    for sample_l2 is SAMPLE_L2_FLOOR_EPS = 0.6 eps of the map's dtype (bf16 4.7e-3, against 1.56e-2
    for the per-token inf norm), never below float32's (the residual itself is float32: 7.2e-8).
    Attractor's recipes ask 3e-4 / 2e-4 / 1.5e-4 in bf16 (issue 38): below this floor at CPU scale,
    so fpscale raises them in bf16 runs, with the warning naming the key. Not measured: the floor of
    a trained model at their width (gates learned up to gamma_max 0.75-1.0), which may differ.
  * ``norm: l2`` (per token: ||f(z) - z||_2 / ||f(z)||_2 over a token's channels) averages the rounding
    over a token's channels: its slowest token of the batch sits far below the inf norm's 2 eps. Measured
    at initialisation, bf16 weights and autocast, tol 0 for 40-60 iterations, B 4, T 128, 2-3 seeds, the
    lowest residual the slowest token reached (tail median in brackets):
      attractor (gate 0.1, d 128; bench/sample_l2_floor.py --norm l2)  0.53-0.62 eps (0.61-0.70 eps)
      tiny_fpsa 0.53-0.58 eps, tiny_looped 0.27-0.28 eps, tiny_fpmamba 0.02-0.03 eps
    so its floor is L2_FLOOR_EPS = 1 eps of the map's dtype (bf16 7.8e-3), above every one of these.
    It is what the causal Attractor recipes (configs/*_attractor.yaml, bf16) take as their tolerance.
    A float32 map keeps 2 float32 eps (2.4e-7), the inf norm's: rounding is not all that limits it there
    (the attractor head above bottomed out at 3.0e-7 in fp32, 2.5 eps: a tol between the two runs to the cap).
  * a float64 map keeps its per-token residual in float64 (iterate.py ``token_residual``), so under ``l2``
    its floor is float64's 2 eps (4.4e-16), as under the inf norm (issue 48; it was held at float32's 2.4e-7).
    ``sample_l2``'s residual is float32 for bf16 and float32 maps (anderson.py ``sample_residual``, as
    Attractor's solvers.py:5-6 ``_rel_residual``) and float64 for a float64 map (fpscale's deviation:
    theirs casts to float32 and a float64 reference solve stopped at 7.2e-8): its floor there is
    SAMPLE_L2_FLOOR_EPS float64 eps (1.3e-16).
"""
from __future__ import annotations

import warnings

import torch


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32: where a looped layer keeps its iterate and the elementwise
    algebra on it; float64 stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def map_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype a map's products run in: autocast's when it is on for the device, else ``like``'s."""
    kind = like.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return like.dtype


TF32_EPS = 2.0 ** -10          # TF32: float32's range, 10 explicit mantissa bits
SAMPLE_L2_FLOOR_EPS = 0.6      # sample_l2's floor in eps of the map's dtype (module docstring: measured)
L2_FLOOR_EPS = 1.0             # the per-token l2 norm's (module docstring: measured)


def tf32_matmuls(like: torch.Tensor) -> bool:
    """Whether a float32 product on ``like``'s device runs on TF32 tensor cores (CUDA with
    ``torch.backends.cuda.matmul.allow_tf32``, as fpscale.train.precision sets it for fp32 runs)."""
    return like.is_cuda and torch.backends.cuda.matmul.allow_tf32


def residual_floor(dtype: torch.dtype, tf32: bool = False, norm: str = "inf") -> float:
    """The smallest relative residual a map computing in ``dtype`` reaches reliably: 2 eps (a
    float32 map whose matmuls run in TF32, ``tf32``: 2 TF32 eps); for ``norm`` sample_l2,
    SAMPLE_L2_FLOOR_EPS eps, never below float32's for a bf16 or float32 map (its residual is float32
    there, as Attractor's; float64 for a float64 map), and for the
    per-token l2, L2_FLOOR_EPS eps, never below 2 eps of the residual's dtype (the state's: float64 for a
    float64 map, which thus solves to float64's resolution, as under the inf norm)."""
    if norm in ("sample_l2", "l2"):
        if not dtype.is_floating_point:
            return 0.0
        # the residual's dtype: the state's, at least float32 (sample_l2: Attractor's _rel_residual in float32,
        # fpscale.solvers.anderson.sample_residual; both norms keep float64 for a float64 map)
        resid = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
        eps = TF32_EPS if tf32 and dtype == torch.float32 else max(torch.finfo(dtype).eps, resid)
        if norm == "sample_l2":
            return SAMPLE_L2_FLOOR_EPS * eps
        return max(L2_FLOOR_EPS * eps, 2 * resid)
    if tf32 and dtype == torch.float32:
        return 2 * TF32_EPS
    return 2 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


_warned: set = set()


def unreachable(tol: float, dtype: torch.dtype, tf32: bool = False, norm: str = "inf") -> bool:
    """Whether ``tol`` lies below what a map computing in ``dtype`` resolves. A tolerance of 0
    asks for no tolerance stop at all (run to the cap): never unreachable."""
    return 0 < tol < residual_floor(dtype, tf32, norm)


def resolvable_tol(tol: float, dtype: torch.dtype, what: str = "tol", tf32: bool = False,
                   norm: str = "inf") -> float:
    """``tol`` raised to the floor of ``dtype`` (of TF32 for a float32 map with ``tf32``) where it
    is unreachable, warning once per (what, tol, dtype)."""
    if not unreachable(tol, dtype, tf32, norm):
        return tol
    floor = residual_floor(dtype, tf32, norm)
    name = "tf32" if tf32 and dtype == torch.float32 else str(dtype).replace("torch.", "")
    if (what, tol, name) not in _warned:
        _warned.add((what, tol, name))
        warnings.warn(f"solver {what} = {tol:g} is below what a map computed in {name} "
                      f"can resolve (relative residual floor {floor:.3g}): using {floor:.3g}", stacklevel=3)
    return floor
