"""q, k and v reach attention in the compute dtype under bf16: one-process autocast (fp32 weights,
bf16 products) and DeepSpeed's bf16 mode (the model cast to bf16). RoPE must not leave q and k in
float32 beside a bf16 v: SDPA would get mixed dtypes and flash-attn (``flash_attn_for``, which
looks at q's dtype) would be declined on a GPU. ``fpscale.ops.kernels`` records the dtypes each
``causal_attention`` call received (``sdpa bf16`` vs ``sdpa q float32 k float32 v bfloat16``)."""
import warnings

import pytest
import torch

import fpscale
from fpscale.layers.common import apply_rope, rope_span, rope_tables
from fpscale.ops import kernels
from tests.models.helpers import tiny_model

KINDS = [("attn", {}), ("fpsa", {}), ("looped", {}), ("epsilon", {"attention": "causal"})]
IDS = [k for k, _ in KINDS]


def attention_calls(model, run) -> dict[str, int]:
    """{kernel label: calls} of ``causal_attention`` during ``run(model)``."""
    kernels.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # bf16 raises tolerances below its floor, with a warning
        run(model)
    return kernels.used().get("attention", {})


def forward(precision: str, tokens: torch.Tensor):
    def run(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            model(tokens).float().sum().backward() if model.training else model(tokens)
    return run


def bf16_model(kind: str, precision: str, spec: dict):
    """A tiny model of ``kind``: fp32 weights for autocast, cast to bf16 as DeepSpeed's bf16 mode does."""
    return tiny_model(kind, dtype=torch.bfloat16 if precision == "cast" else torch.float32, **spec)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("precision", ["autocast", "cast"])
@pytest.mark.parametrize("kind,spec", KINDS, ids=IDS)
def test_q_k_v_reach_attention_in_bf16(kind, spec, precision, training):
    model = bf16_model(kind, precision, spec).train(training)
    tokens = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    calls = attention_calls(model, forward(precision, tokens))
    assert calls and set(calls) == {"sdpa bf16"}, calls


@pytest.mark.parametrize("precision", ["autocast", "cast"])
@pytest.mark.parametrize("kind,spec", KINDS, ids=IDS)
def test_decoding_with_caches_reaches_attention_in_bf16(kind, spec, precision):
    """The cached path: past keys (rotated when they were new) meet the new token's q, k, v."""
    model = bf16_model(kind, precision, spec)
    prompt = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            fpscale.generate(m, prompt, 3)

    calls = attention_calls(model, run)
    assert calls and set(calls) == {"sdpa bf16"}, calls


@pytest.mark.parametrize("kind,spec", KINDS, ids=IDS)
def test_fp32_reaches_attention_in_fp32(kind, spec):
    model = tiny_model(kind, **spec).eval()
    calls = attention_calls(model, forward("fp32", torch.randint(0, 32, (2, 24))))
    assert calls and set(calls) == {"sdpa fp32"}, calls


def test_rope_rotates_in_float32_and_rounds_once_to_the_input_dtype():
    """bf16 q/k: the tables stay float32 (``rope_span`` of a bf16 tensor) and the rotation is the
    float32 rotation of the same values, rounded once to bf16; float32 is the float32 rotation."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 64, 16, generator=g)
    cos, sin = rope_span(16, 3, 64, 10000.0, x.to(torch.bfloat16))
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal((cos, sin)[0], rope_tables(16, torch.arange(3, 67), 10000.0, torch.float32)[0])
    xb = x.to(torch.bfloat16)
    out = apply_rope(xb, cos, sin)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rope(xb.float(), cos, sin).to(torch.bfloat16))
    x1, x2 = x.chunk(2, dim=-1)            # float32: exactly the textbook rotation, as before
    assert torch.equal(apply_rope(x, cos, sin), torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))
    x64 = x.double()
    c64, s64 = rope_span(16, 3, 64, 10000.0, x64)
    assert c64.dtype == torch.float64 and apply_rope(x64, c64, s64).dtype == torch.float64
