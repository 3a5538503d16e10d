"""``decode.cache: fixed_point``: one cache entry per past token (what the map reads at its fixed point),
equal to recomputing the sequence where the solves converge, a plain model's cache size, and a new
token that stops at its own convergence (docs/decoding.md). ``exact`` is tests/models/test_generate.py."""
from pathlib import Path

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.layers.step_cache import TokenBuffer
from fpscale.models import ModelConfig, layer_spec
from tests.models.helpers import TYPES, tiny_model

ROOT = Path(__file__).resolve().parents[2]
SOLVER = {"tol": 1e-6, "max_iter": 300, "patience": 5, "decay": 0.7, "eta_min": 1e-4}


def storage_bytes(obj, seen=None) -> int:
    """Bytes of every storage a decoding cache holds, each once (bench/decode.py's count)."""
    seen = set() if seen is None else seen
    if isinstance(obj, TokenBuffer):            # its preallocated capacity (model.max_seq_len) counts
        obj = obj.data
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(storage_bytes(v, seen) for v in values)


def attractor_model(solver: dict, seed: int = 0):
    cfg = fpscale.load_config(None, [])
    cfg.model = ModelConfig(vocab_size=32, d_model=32, n_heads=4, max_seq_len=128, layers=[
        layer_spec("attn"), layer_spec("attractor", head_blocks=2, gate_init=0.1,
                                       solver={**solver, "decisions": "token", "norm": "l2", "anderson": 5})])
    cfg.model.validate()
    torch.manual_seed(seed)
    return fpscale.build_model(cfg)


def model_of(kind: str, solver: dict):
    if kind == "attractor":
        return attractor_model(solver)
    return tiny_model(kind, solver=solver, **({"conv": True} if kind == "looped" else {}))


@pytest.mark.parametrize("kind", TYPES[1:] + ["attractor"])
def test_fixed_point_cache_equals_recomputation_where_the_solves_converged(kind):
    model = model_of(kind, SOLVER)
    prompt = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    stats: list = []
    cached, cached_logits = fpscale.generate(model, prompt, 8, return_logits=True, cache="fixed_point", stats=stats)
    full, full_logits = fpscale.generate(model, prompt, 8, use_cache=False, return_logits=True)
    assert all(why == "converged" for st in model.solver_stats().values() for why in [st.stopped_by])
    assert max(it for step in stats for it in step.values()) < SOLVER["max_iter"]     # no solve at its cap
    assert torch.equal(cached, full)
    assert torch.allclose(cached_logits, full_logits, rtol=0, atol=1e-3), \
        float((cached_logits - full_logits).abs().max())


@pytest.mark.parametrize("kind", ["looped", "attractor"])
def test_at_a_capped_depth_fixed_point_differs_from_exact_which_equals_recomputation(kind):
    """Where the solve stops at its cap the past's fixed point is not what the full forward read:
    fixed_point then gives another (bounded) result, exact the full forward's."""
    model = model_of(kind, {**SOLVER, "tol": 0.0})
    prompt = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(3))
    with model.eval_depth(2):
        _, full = fpscale.generate(model, prompt, 4, use_cache=False, return_logits=True)
        _, exact = fpscale.generate(model, prompt, 4, return_logits=True, cache="exact")
        _, fixed = fpscale.generate(model, prompt, 4, return_logits=True, cache="fixed_point")
    exact_err, fixed_err = ((t[:, 1:] - full[:, 1:]).abs().max() for t in (exact, fixed))
    assert exact_err < 1e-5 and fixed_err > 20 * max(exact_err, 1e-6), (exact_err, fixed_err)
    assert torch.equal(fixed[:, 0], full[:, 0])         # the first step is the prompt's: no cache read


def test_fixed_point_cache_is_a_plain_models_size_per_attention_block():
    """A looped core of 2 blocks caches 2 blocks' K/V per token, as 2 attn layers do; exact keeps
    (iterations + 1) of them (here its cache is several times larger)."""
    prompt = torch.randint(0, 32, (1, 126), generator=torch.Generator().manual_seed(0))      # max_seq_len 128
    sizes = {}
    for kind, mode in [("attn", "exact"), ("looped", "exact"), ("looped", "fixed_point"), ("fpsa", "fixed_point")]:
        model = tiny_model(kind, **({"core_blocks": 2} if kind == "looped" else {})).eval()
        caches = model.new_caches()
        with torch.no_grad(), model.decode_cache(mode):
            logits = model(prompt, caches=caches)
            model(logits[:, -1:].argmax(-1), caches=caches, pos=prompt.shape[1])
        blocks = 2 if kind == "looped" else 1
        sizes[kind, mode] = storage_bytes(caches) / blocks
    plain = sizes["attn", "exact"]
    assert plain == 2 * 128 * 32 * 4, sizes         # K and V of 128 tokens (preallocated), d 32, fp32
    assert sizes["looped", "fixed_point"] <= 1.25 * plain, (sizes, plain)
    assert sizes["fpsa", "fixed_point"] <= 1.25 * plain, (sizes, plain)
    assert sizes["looped", "exact"] > 2 * plain, (sizes, plain)


def test_a_new_token_stops_at_its_own_convergence():
    """exact makes every new token run as many iterations as the past recorded (the prompt's solve, here
    at its cap); fixed_point lets it stop when it converges: fewer iterations per decoded token."""
    model = model_of("looped", {**SOLVER, "tol": 1e-4, "max_iter": 40})
    prompt = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(3))
    runs = {}
    for mode in ("exact", "fixed_point"):
        stats: list = []
        fpscale.generate(model, prompt, 6, cache=mode, stats=stats)
        runs[mode] = [step["layers.0.looped"] for step in stats]
    assert runs["exact"][0] == runs["fixed_point"][0]                 # the prompt: the same solve
    assert all(e >= runs["exact"][0] for e in runs["exact"][1:]), runs
    assert sum(runs["fixed_point"][1:]) < sum(runs["exact"][1:]), runs


def test_the_mode_is_a_validated_config_key_and_a_cache_keeps_its_mode():
    with pytest.raises(ConfigError, match="decode.cache.*exact, fixed_point.*'kv'"):
        fpscale.load_config(None, ["decode.cache=kv"])
    cfg = fpscale.load_config(str(ROOT / "configs/tiny_looped.yaml"), ["decode.cache=fixed_point"])
    model = fpscale.build_model(cfg)
    assert [m.decode_cache for m in model.looped_layers().values()] == ["fixed_point"]
    with pytest.raises(ValueError, match="decode.cache must be one of"):
        fpscale.generate(model, torch.zeros(1, 3, dtype=torch.long), 2, cache="kv")
    model = tiny_model("looped").eval()
    caches = model.new_caches()
    with torch.no_grad():
        with model.decode_cache("exact"):
            model(torch.zeros(1, 3, dtype=torch.long), caches=caches)
        with model.decode_cache("fixed_point"), pytest.raises(RuntimeError, match="keep one mode"):
            model(torch.zeros(1, 1, dtype=torch.long), caches=caches, pos=3)


@pytest.mark.slow           # dynamo traces the model (~25 s; exact's cache, measured alike, is left out for time)
def test_a_compiled_decode_step_compiles_no_new_graph_per_token():
    """The model's forward under torch.compile (train.compile: full, dynamo's eager backend: the counts do not
    depend on the device): the prompt and the first two decoded tokens compile (the second marks the growing
    cache length dynamic); every later token reuses those graphs, and the logits are eager's. The graph
    breaks are the solver's host reads (docs/decoding.md)."""
    from torch._dynamo.utils import counters

    from fpscale.parallel.compile import apply_compile
    cfg = fpscale.load_config(str(ROOT / "configs/tiny_looped.yaml"))
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).eval()
    torch.manual_seed(0)
    eager = fpscale.build_model(cfg).eval()
    apply_compile(model, "full", backend="eager")
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    new_graphs = []
    with torch.no_grad(), model.decode_cache("fixed_point"), eager.decode_cache("fixed_point"):
        caches, eager_caches = model.new_caches(), eager.new_caches()
        model(tokens, caches=caches), eager(tokens, caches=eager_caches)
        for pos in range(16, 22):
            before = counters["stats"]["unique_graphs"]
            step = tokens[:, -1:]
            torch.testing.assert_close(model(step, caches=caches, pos=pos), eager(step, caches=eager_caches, pos=pos),
                                       rtol=1e-5, atol=1e-6)
            new_graphs.append(counters["stats"]["unique_graphs"] - before)
    assert new_graphs[0] > 0 and new_graphs[2:] == [0] * 4, new_graphs
