"""Decoding with caches (only the new token is iterated) equals recomputing the sequence."""
import pytest
import torch

import fpscale
from tests.models.helpers import TYPES, tiny_model

SOLVER = {"tol": 1e-6, "max_iter": 300, "patience": 5, "decay": 0.7, "eta_min": 1e-4}


# mixed (every layer type in one stack, 3-4 s on the loaded machine) in the full suite only; the quick
# loop keeps each type through its own case
@pytest.mark.parametrize("layer_type", TYPES + [pytest.param("mixed", marks=pytest.mark.slow)])
def test_cached_decoding_matches_full_recompute(layer_type):
    model = tiny_model(layer_type, solver=SOLVER, **({"conv": True} if layer_type == "looped" else {}))
    prompt = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    cached, cached_logits = fpscale.generate(model, prompt, 12, use_cache=True, return_logits=True)
    full, full_logits = fpscale.generate(model, prompt, 12, use_cache=False, return_logits=True)
    assert torch.equal(cached, full)
    assert cached.shape == (2, 21) and torch.equal(cached[:, :9], prompt)
    tol = 0.0 if layer_type == "attn" else 1e-3      # within the solver tolerance
    assert torch.allclose(cached_logits, full_logits, rtol=0, atol=max(tol, 1e-5)), \
        float((cached_logits - full_logits).abs().max())


def test_sampling_is_reproducible_and_bad_arguments_fail():
    model = tiny_model("attn")
    prompt = torch.randint(0, 32, (1, 4))
    a = fpscale.generate(model, prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    b = fpscale.generate(model, prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="temperature"):
        fpscale.generate(model, prompt, 3, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len = 128"):
        fpscale.generate(model, prompt, 200)
