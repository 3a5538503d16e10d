"""Static decoding caches (``LoopedLM.new_caches(static=True)``, ``generate(..., static=True)``): every decoding
step has the shapes of the first (attention over the preallocated capacity under a mask, the position a tensor),
so a forward compiled with ``dynamic=False`` is built once and later tokens reuse it; the tokens and logits are
the dynamic cache's (docs/decoding.md, "Static caches")."""
from pathlib import Path

import pytest
import torch

import fpscale
from fpscale.ops.attention import causal_attention, causal_mask
from tests.models.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(1))
PAD = torch.tensor([0, 3, 6])          # left padding: rows of 10, 7 and 4 real tokens


def test_a_static_mask_is_causal_attention_over_the_filled_part():
    """Attention over a capacity of 16 under ``causal_mask`` at a tensor position equals attention over the 9
    filled keys (the bottom-right causal mask, left padding hidden); the unfilled slots hold zeros (a static
    buffer's), read with weight 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g) for n in (2, 9, 9))
    pad = torch.tensor([0, 2, 5])
    ref = causal_attention(q, k, v, pad=pad)
    room = torch.zeros(3, 2, 7, 8)
    got = causal_attention(q, torch.cat([k, room], 2), torch.cat([v, room], 2),
                           pad=causal_mask(pad, torch.tensor(7), 2, 16, q.device))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    unpadded = causal_attention(q, k, v)
    got = causal_attention(q, torch.cat([k, room], 2), torch.cat([v, room], 2),
                           pad=causal_mask(None, 7, 2, 16, q.device))
    torch.testing.assert_close(got, unpadded, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["attn", "fpsa", "fpmamba", "looped", "attractor", "mixed"])
def test_static_caches_decode_what_dynamic_ones_do(kind):
    """A batch of left-padded prompts: greedy tokens equal, logits within float32 rounding (the attention sums
    over zero-weighted unfilled slots in another order)."""
    model = tiny_model(kind, **({"conv": True} if kind == "looped" else {}))
    out = {}
    for static in (False, True):
        out[static] = fpscale.generate(model, PROMPTS, 8, pad=PAD, cache="fixed_point", return_logits=True,
                                       static=static)
    assert torch.equal(out[False][0], out[True][0])
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=2e-5)


def test_a_static_cache_holds_its_capacity_and_counts_on_the_device():
    model = tiny_model("looped").eval()
    with torch.no_grad(), model.decode_cache("fixed_point"):
        caches = model.new_caches(static=True)
        model(PROMPTS, caches=caches, pos=torch.tensor(0), pad=PAD)
        model(PROMPTS[:, -1:], caches=caches, pos=torch.tensor(10), pad=PAD)
    k = caches[0]["steps"]["iters"]["k0"]
    assert k.static and k.data.shape[2] == model.cfg.max_seq_len and k.n.device == k.data.device and int(k.n) == 11


def test_static_caches_refuse_what_they_cannot_hold():
    model = tiny_model("looped")
    with pytest.raises(ValueError, match="static decoding caches need decode.cache: fixed_point.*'exact'"):
        fpscale.generate(model, PROMPTS, 2, cache="exact", static=True)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len = 128 .*static cache"):
        fpscale.generate(model, PROMPTS, 120, cache="fixed_point", static=True)
    with pytest.raises(ValueError, match="use_cache must be True"):
        fpscale.generate(model, PROMPTS, 2, cache="fixed_point", static=True, use_cache=False)
    halting = tiny_model("epsilon")
    with pytest.raises(ValueError, match="layers.0.epsilon is a halting loop"):
        fpscale.generate(halting, PROMPTS, 2, cache="fixed_point", static=True)


def compiled_decode(config: str, static: bool) -> tuple[list[int], int, float]:
    """The model's forward under ``torch.compile(dynamic=False)`` (dynamo's eager backend: the counts do not depend
    on the device) decoding 6 tokens after a padded prompt: the graphs each step compiled, the graph breaks, and
    the largest difference from the eager model's logits."""
    from torch._dynamo.utils import counters
    cfg = fpscale.load_config(str(ROOT / f"configs/{config}.yaml"))
    torch.manual_seed(0)
    model = fpscale.build_model(cfg).eval()
    torch.manual_seed(0)
    eager = fpscale.build_model(cfg).eval()
    model.forward = torch.compile(model.forward, dynamic=False, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    tokens, pad = PROMPTS[:2, :8], PAD[:2]
    place = (lambda n: torch.tensor(n)) if static else (lambda n: n)
    new, err = [], 0.0
    with torch.no_grad(), model.decode_cache("fixed_point"), eager.decode_cache("fixed_point"):
        caches, eager_caches = model.new_caches(static=static), eager.new_caches()
        model(tokens, caches=caches, pos=place(0), pad=pad), eager(tokens, caches=eager_caches, pad=pad)
        for pos in range(8, 14):
            before = counters["stats"]["unique_graphs"]
            step = tokens[:, -1:]
            got, want = model(step, caches=caches, pos=place(pos), pad=pad), eager(step, caches=eager_caches, pos=pos,
                                                                                    pad=pad)
            err = max(err, float((got - want).abs().max()))
            new.append(counters["stats"]["unique_graphs"] - before)
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return new, breaks, err


@pytest.mark.slow           # dynamo traces the models (~25 s)
def test_a_static_step_compiles_once_with_dynamic_false():
    """tiny_attn: the first decoded token compiles one graph without a break (the step CUDA graphs can capture),
    every later token reuses it; with dynamic caches every token compiles a new graph (its cache length and
    position are constants of the graph). tiny_looped: the graphs between the solver's host reads compile at
    the first decoded token and are reused (its solves take iteration counts already seen)."""
    new, breaks, err = compiled_decode("tiny_attn", static=True)
    assert new[0] == 1 and new[1:] == [0] * 5 and breaks == 0 and err < 1e-5, (new, breaks, err)
    new, _, _ = compiled_decode("tiny_attn", static=False)
    assert all(n >= 1 for n in new[:5]), new       # (the 8 recompilations of dynamo's limit: then eager)
    new, breaks, err = compiled_decode("tiny_looped", static=True)
    assert new[0] > 0 and new[1:] == [0] * 5 and breaks > 0 and err < 1e-5, (new, breaks, err)
