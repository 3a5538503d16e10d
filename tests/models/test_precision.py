"""bf16 beside fp32 (fpscale.solvers.precision): the same weights and inputs take the same solver
work in bf16 as in fp32, through a plain ``.to(torch.bfloat16)``, autocast (one-process bf16
training) and DeepSpeed's bf16 engine (tests/parallel/run_precision.py)."""
import copy
import functools
import os
import warnings

import pytest
import torch

import fpscale
from fpscale.solvers import SolverConfig, solve
from fpscale.solvers.precision import residual_floor
from tests.models.helpers import TINY_LOOPED_CONFIGS, assert_iterates_alike, solver_iterations, token_batches
from tests.parallel.launch import ROOT, read_ranks, torchrun


def load(name: str, precision: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # bf16 raises tolerances below its floor, with a warning
        return fpscale.load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [f"train.precision={precision}"])


@functools.lru_cache(maxsize=None)
def fp32_reference(name: str, training: bool):
    """fp32's iterations on ``token_batches`` (and the batches): computed once per config and mode for
    the file (the quick tests and each rank of the DeepSpeed test read the same; nothing mutates them)."""
    cfg = load(name, "fp32")
    torch.manual_seed(cfg.seed)                    # the Trainer's initial weights
    model = fpscale.build_model(cfg)
    batches = token_batches(cfg.model.vocab_size)
    return solver_iterations(model.hidden, model, batches, training), batches


# tiny_mixed (every looped type of the other three at once, the quick loop's heaviest 8 s) runs in the
# full suite only; the quick loop keeps each looped type through its own config
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "tiny_mixed" else n
                                  for n in TINY_LOOPED_CONFIGS])
def test_bf16_takes_the_iterations_of_fp32(name, training):
    ref, batches = fp32_reference(name, training)
    cfg = load(name, "bf16")
    torch.manual_seed(cfg.seed)
    model = fpscale.build_model(cfg)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    assert_iterates_alike(ref, solver_iterations(cast.hidden, cast, batches, training), ".to(bfloat16)")
    assert_iterates_alike(ref, solver_iterations(model.hidden, model, batches, training, autocast=True), "autocast")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeed_bf16_engine_takes_the_iterations_of_fp32(tmp_path):
    torchrun(2, "tests/parallel/run_precision.py", [str(tmp_path), *TINY_LOOPED_CONFIGS], timeout=400)
    ranks = read_ranks(str(tmp_path))
    assert len(ranks) == 2
    for name in TINY_LOOPED_CONFIGS:
        assert all(r[name]["param_dtype"] == "torch.bfloat16" for r in ranks)   # DeepSpeed's bf16 mode cast them
        for training, mode in ((False, "eval"), (True, "train")):
            ref, _ = fp32_reference(name, training)
            # rank r ran batches r, r + 2, ...: joined in batch order, every batch of the reference
            got = {k: [tuple(x) for x in v] for k, v in ranks[0][name][mode].items()}
            for k, v in ranks[1][name][mode].items():
                got[k] = [b for pair in zip(got[k], map(tuple, v)) for b in pair] + got[k][len(v):]
            assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in ref.items()}
            assert_iterates_alike(ref, got, f"DeepSpeed bf16 {mode}")


def test_the_solver_state_is_float32_whatever_f_computes_in():
    """f in bf16: the iterate, residuals and damping stay float32, and a contraction converges
    to what bf16 resolves instead of stalling on the bf16 grid."""
    W = (0.5 * torch.eye(16)).to(torch.bfloat16)
    x = torch.randn(4, 8, 16).to(torch.bfloat16)
    seen = []

    def f(z):
        seen.append(z.dtype)
        return z.to(torch.bfloat16) @ W + x

    with torch.no_grad():
        z, stats = solve(f, torch.zeros_like(x), SolverConfig(tol=0.02, max_iter=50, damping=0.9), training=False)
    assert set(seen) == {torch.float32} and z.dtype == torch.float32 and stats.final_eta.dtype == torch.float32
    assert stats.stopped_by == "converged"


def test_a_tolerance_below_the_dtype_floor_is_raised_once_with_a_warning():
    floor = residual_floor(torch.bfloat16)
    x = torch.randn(2, 3, 4).to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"solver tol = 1e-05 is below what a map computed in bfloat16"), \
            torch.no_grad():
        _, stats = solve(lambda z: 0.5 * z.to(torch.bfloat16) + x, torch.zeros_like(x), SolverConfig(tol=1e-5),
                         training=False)
    assert stats.tol == floor and stats.stopped_by == "converged"
    with torch.no_grad():
        _, stats32 = solve(lambda z: 0.5 * z + x.float(), torch.zeros_like(x.float()), SolverConfig(tol=1e-5),
                           training=False)
    assert stats32.tol == 1e-5


def test_a_float64_map_solves_to_float64_resolution_under_l2():
    """Issue 48: the l2 floors follow the map's dtype (float64: 2 float64 eps per token, 0.6 float64 eps for
    sample_l2, whose residual is float64 there), so a float64 solve at tol 1e-10 is not raised to float32's
    2.4e-7 / 7.2e-8 and reaches it, under both norms; a bf16 or float32 map keeps sample_l2's float32
    residual (Attractor's) and its floor."""
    assert residual_floor(torch.float64, norm="l2") == 2 * torch.finfo(torch.float64).eps
    assert residual_floor(torch.float32, norm="l2") == 2 * torch.finfo(torch.float32).eps
    assert residual_floor(torch.float64, norm="sample_l2") == pytest.approx(0.6 * torch.finfo(torch.float64).eps)
    assert residual_floor(torch.float32, norm="sample_l2") == pytest.approx(0.6 * torch.finfo(torch.float32).eps)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    for norm in ("l2", "sample_l2"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                z, stats = solve(lambda z: 0.5 * z + x, torch.zeros_like(x),
                                 SolverConfig(tol=1e-10, norm=norm, max_iter=80), training=False)
        assert stats.tol == 1e-10 and stats.stopped_by == "converged", norm
        assert stats.sample_residual.dtype == torch.float64 and stats.sample_residual.max() < 1e-10, norm
        assert ((z - 2 * x).norm(dim=-1) / (2 * x).norm(dim=-1)).max() < 1e-9, norm
