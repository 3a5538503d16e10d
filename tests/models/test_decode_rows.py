"""``decode.compact`` (fpscale.solvers.rows): in ``fixed_point`` decoding a batch's done rows leave the solve; the
decode equals the uncompacted one (greedy tokens identical; logits within 2e-5 in float32, measured up to 4e-6
(fpmamba) and 8.5e-6 (fpmamba2): not 0 because a restricted map's batched products round otherwise than the
whole batch's, and the next tokens read what those rows computed) and f computes fewer rows.

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


@pytest.mark.parametrize("kind", ["fpsa", "looped"])
def test_exact_mode_does_not_compact(kind):
    """``exact`` keeps the loop over every row (its per-iteration entries are recorded for every row): the
    same logits bit for bit with compact on or off, and f on every row at every iteration."""
    model = spread_model(kind)
    ref, ref_logits, _ = decode(model, compact=False, cache="exact", steps=3)
    out, logits, stats = decode(model, compact=True, cache="exact", steps=3)
    assert torch.equal(out, ref) and torch.equal(logits, ref_logits)
    assert all(s.rows[name] == 4 * s[name] for s in stats for name in s)


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
