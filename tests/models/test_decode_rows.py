"""``decode.compact`` (fpscale.solvers.rows): in decoding a batch's done rows leave the solve; the decode equals
the uncompacted one and f computes fewer rows. ``fixed_point`` mode: greedy tokens identical, logits within 2e-5
in float32, measured up to 4e-6 (fpmamba) and 8.5e-6 (fpmamba2): not 0 because a restricted map's batched
products round otherwise than the whole batch's, and the next tokens read what those rows computed. ``exact``
mode (in float64): the same solves, and logits and every cache entry within 1e-10.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python -m pytest -q -n 0 tests/models/test_decode_rows.py
"""
import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from tests.models.helpers import tiny_model
from tests.models.test_decode_cache import SOLVER, attractor_model

TOL = 2e-5


def spread_model(kind: str, solver: dict = SOLVER):
    """A tiny model whose rows converge at different iterations: the embedding rows scaled 0.2 .. 6 (the
    tokens' inputs differ in size, so their solves in length); fpsa's map without its spectral norm and its
    weights x 6 (normed, every row converges alike)."""
    if kind == "attractor":
        model = attractor_model(solver)
    else:
        spec = {"conv": True} if kind == "looped" else {"spectral_norm": False} if kind == "fpsa" else {}
        model = tiny_model(kind, solver=solver, **spec)
    with torch.no_grad():
        emb = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
        emb.weight.mul_(torch.linspace(0.2, 6.0, emb.weight.shape[0])[:, None])
        if kind == "fpsa":
            for p in next(iter(model.looped_layers().values())).parameters():
                if p.dim() == 2:
                    p.mul_(6.0)
    return model


def decode(model, compact: bool, cache: str = "fixed_point", steps: int = 6):
    prompt = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(3))
    pad = torch.tensor([0, 3, 5, 1])          # prompts of 9, 6, 4 and 8 tokens
    stats: list = []
    out, logits = fpscale.generate(model, prompt, steps, return_logits=True, cache=cache, stats=stats, pad=pad,
                                   compact=compact)
    return out, logits, stats


def totals(stats) -> tuple[int, int]:
    """(iterations, row-iterations) over the decoded tokens' forwards and the looped layers."""
    return (sum(v for s in stats[1:] for v in s.values()), sum(v for s in stats[1:] for v in s.rows.values()))


@pytest.mark.parametrize("kind", ["fpsa", "looped", "fpmamba", pytest.param("attractor", marks=pytest.mark.slow),
                                  pytest.param("fpmamba2", marks=pytest.mark.slow)])
def test_compacted_decoding_equals_uncompacted_with_fewer_rows_computed(kind):
    model = spread_model(kind)
    ref, ref_logits, ref_stats = decode(model, compact=False)
    out, logits, stats = decode(model, compact=True)
    assert torch.equal(out, ref)
    assert torch.allclose(logits, ref_logits, rtol=0, atol=TOL), float((logits - ref_logits).abs().max())
    iterations, rows = totals(ref_stats)
    assert rows == 4 * iterations                     # uncompacted: f on every row at every iteration
    assert totals(stats)[1] < rows, (totals(stats), rows)
    assert all(s.rows[name] <= 4 * s[name] for s in stats for name in s)


def exact_prompt() -> torch.Tensor:
    """Random prompts, rows 1 and 2 one token repeated (they converge early): in ``exact`` mode a row's new token
    retires no earlier than its past did (the prefix rule), so rows leave where whole rows are early. (Seed 9:
    every solve of the four quick types converges, none stops at its cap.)"""
    prompt = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(9))
    prompt[1:3] = prompt[1:3, :1]
    return prompt


def greedy_exact(model, compact: bool, steps: int = 6):
    """``fpscale.generate``'s greedy loop in ``exact`` mode, keeping what it does not return: (tokens, logits,
    each forward's solver statistics, the caches after the last)."""
    tokens, pad = exact_prompt(), torch.tensor([0, 3, 5, 1])
    caches, logits, stats = model.new_caches(), [], []
    with model.decode_cache("exact", compact), torch.no_grad():
        new, pos = tokens, 0
        for _ in range(steps):
            logits.append(model(new, caches=caches, pos=pos, pad=pad)[:, -1])
            stats.append(model.solver_stats())
            new, pos = logits[-1].argmax(-1, keepdim=True), tokens.shape[1]
            tokens = torch.cat([tokens, new], 1)
    return tokens, torch.stack(logits, 1), stats, caches


def cache_tensors(obj, path: str = ""):
    """(path, tensor) of every tensor a decoding cache holds (a TokenBuffer's filled part)."""
    if isinstance(obj, (dict, list)):
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            yield from cache_tensors(value, f"{path}/{key}")
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif obj is not None and not isinstance(obj, str):
        yield path, obj.view()


@pytest.mark.parametrize("kind", ["fpsa", "looped", "fpmamba", pytest.param("attractor", marks=pytest.mark.slow),
                                  pytest.param("fpmamba2", marks=pytest.mark.slow)])
def test_exact_compacted_decoding_equals_uncompacted_with_fewer_rows_computed(kind):
    """``exact`` mode: a row leaves the iteration it froze; at the calls it missed its entries are those of z*
    (``StepCache.store``). In float64, so that rounding (a restricted map's batched products, ~1e-15) stays far
    below what a wrong entry would change (the last recorded one instead, of the iterate before z*: about the
    solve's tolerance, 1e-6, and this test fails so): the same greedy tokens, solves (iterations, retirements,
    per-entry counts), logits and every cache entry within 1e-10, and fewer rows computed."""
    model = spread_model(kind).double().eval()
    ref, ref_logits, ref_stats, ref_caches = greedy_exact(model, compact=False)
    out, logits, stats, caches = greedy_exact(model, compact=True)
    assert torch.equal(out, ref)
    assert torch.allclose(logits, ref_logits, rtol=0, atol=1e-10), float((logits - ref_logits).abs().max())
    for step, ref_step in zip(stats, ref_stats):
        for name, st in step.items():
            r = ref_step[name]
            assert (st.iterations, st.stopped_by) == (r.iterations, r.stopped_by)
            assert torch.equal(st.retired_at, r.retired_at)
            assert (st.entry_iterations is None) == (r.entry_iterations is None)
            assert st.entry_iterations is None or torch.equal(st.entry_iterations, r.entry_iterations)
            assert st.row_iterations <= r.row_iterations == 4 * r.iterations
    pairs = list(zip(cache_tensors(caches), cache_tensors(ref_caches)))
    assert any("/steps/iters/" in path for (path, _), _ in pairs)
    for (path, t), (ref_path, r) in pairs:
        assert path == ref_path and t.shape == r.shape and t.dtype == r.dtype, (path, ref_path)
        assert torch.allclose(t, r, rtol=0, atol=1e-10) if t.is_floating_point() else torch.equal(t, r), path
    assert sum(s[n].row_iterations for s in stats for n in s) < sum(s[n].row_iterations for s in ref_stats for n in s)


def test_sample_decisions_do_not_compact():
    model = spread_model("looped", {**SOLVER, "decisions": "sample"})
    _, _, stats = decode(model, compact=True, steps=3)
    assert all(s.rows[name] == 4 * s[name] for s in stats for name in s)


def test_decode_compact_must_be_a_bool():
    model = tiny_model("looped")
    with pytest.raises(ValueError, match="decode.compact must be true or false"):
        fpscale.generate(model, torch.zeros(1, 3, dtype=torch.long), 1, compact="yes")
    cfg = fpscale.load_config(None, ["decode.compact=false"])
    assert cfg.decode.compact is False
    cfg.decode.compact = "no"
    with pytest.raises(ConfigError, match="decode.compact"):
        cfg.decode.validate()
