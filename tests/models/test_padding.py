"""Left padding: a padded row of a batch computes what the row alone computes, for every layer
type, in the full forward and in cached decoding (what batched generation with an attention
mask, as Hugging Face's generate does it, needs)."""
import pytest
import torch

import fpscale
from tests.models.helpers import tiny_model

SOLVER = {"tol": 1e-6, "max_iter": 300, "patience": 5, "decay": 0.7, "eta_min": 1e-4}
KINDS = {"attn": {}, "fpsa": {}, "fpmamba": {}, "looped": {"conv": True}, "mixed": {},
         "epsilon-hqsa": {"max_steps": 4}, "epsilon-causal": {"max_steps": 4, "attention": "causal"}}


def build(kind: str):
    layer_type = kind.split("-")[0]
    solver = None if layer_type in ("attn", "epsilon") else SOLVER
    return tiny_model(layer_type, solver=solver, **KINDS[kind]).eval()


def left_padded(rows: list[torch.Tensor], fill: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    batch = torch.full((len(rows), T), fill, dtype=torch.long)
    for b, r in enumerate(rows):
        batch[b, T - len(r):] = r
    return batch, torch.tensor([T - len(r) for r in rows])


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_a_padded_row_computes_what_the_row_alone_computes(kind):
    model = build(kind)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 32, (n,), generator=g) for n in (21, 9, 14)]
    batch, pad = left_padded(rows)
    logits = model(batch, pad=pad)
    for b, r in enumerate(rows):
        alone = model(r[None])
        diff = (logits[b, pad[b]:] - alone[0]).abs().max().item()
        assert diff < 1e-5, (kind, b, diff)
    assert torch.isfinite(logits).all()          # padded queries too (they see only themselves)
    # what padding holds is never read: another pad token changes no real token's logits
    other = model(left_padded(rows, fill=3)[0], pad=pad)
    for b in range(len(rows)):
        assert (other[b, pad[b]:] - logits[b, pad[b]:]).abs().max().item() < 1e-5


# mixed (every layer type in one stack, 2 s on the loaded machine) in the full suite only; the quick
# loop keeps each type through its own case
@pytest.mark.parametrize("kind", ["fpsa", "fpmamba", "looped", "epsilon-hqsa",
                                  pytest.param("mixed", marks=pytest.mark.slow)])
def test_batched_generation_with_padding_equals_each_prompt_alone(kind):
    model = build(kind)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 32, (n,), generator=g) for n in (5, 11)]
    batch, pad = left_padded(rows)
    out, logits = fpscale.generate(model, batch, 8, pad=pad, return_logits=True)
    for b, r in enumerate(rows):
        alone, alone_logits = fpscale.generate(model, r[None], 8, return_logits=True)
        assert torch.equal(out[b, pad[b]:], alone[0]), kind
        assert (logits[b] - alone_logits[0]).abs().max().item() < 1e-4


def test_a_bad_pad_tensor_is_refused():
    model = build("attn")
    with pytest.raises(ValueError, match="pad must be a long tensor"):
        model(torch.zeros(2, 4, dtype=torch.long), pad=torch.zeros(3, dtype=torch.long))
