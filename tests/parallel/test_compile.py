"""``train.compile``: compiled plain blocks train as eager does, in whole graphs; a region that cannot
compile is named and runs eager; the key is validated."""
import functools
import warnings

import pytest
import torch

import fpscale
from fpscale.errors import ConfigError
from fpscale.parallel.compile import apply_compile
from fpscale.train.trainer import Trainer
from tests.parallel.launch import pinned

TINY = ["data.source=synthetic", "data.seq_len=16", "data.period=3", "model.vocab_size=64", "model.d_model=32",
        "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=4", "train.log_interval=1",
        "train.warmup=2", "train.export_final=false", "train.save_interval=0", "train.save_interval_minutes=0",
        "train.eval_batches=1", "train.loggers=[]"]


def losses(tmp_path, mode: str, steps: int, *extra: str) -> tuple[list[float], list]:
    """The train losses of a short run, and each compiled region's failure (None: it compiled)."""
    overrides = [*TINY, f"train.steps={steps}", f"train.eval_interval={steps}", f"train.out_dir={tmp_path / mode}",
                 f"train.compile={mode}", *extra]
    # fixed solver depths: Inductor's kernels round otherwise than eager's, where a tolerance stop could flip
    cfg = fpscale.load_config("configs/tiny_mixed.yaml", overrides + pinned("configs/tiny_mixed.yaml", overrides))
    with Trainer(cfg, log=False) as trainer:
        history = trainer.train()
        regions = [functools.reduce(getattr, name.split("."), block) for block in trainer.model.layers
                   for name in (block.compile_regions() if hasattr(block, "compile_regions") else ())]
    return [r["loss"] for r in history if r["kind"] == "train"], [getattr(r, "failed", "eager") for r in regions]


@pytest.mark.slow
def test_compiled_blocks_train_tiny_mixed_as_eager(tmp_path):
    """20 fp32 steps of tiny_mixed (attn, fpsa, fpmamba, looped, attn; every solve 6 iterations) with the MLP
    sublayers recomputed: the same losses, to rounding (rel 1e-5), every declared region compiled (the two
    attn blocks, fpsa's MLP sublayer, fpmamba's input path). Minutes on a shared CPU, almost all of it
    Inductor's build."""
    eager, _ = losses(tmp_path, "none", 20, "model.checkpoint=mlp")
    compiled, failed = losses(tmp_path, "blocks", 20, "model.checkpoint=mlp")
    assert failed == [None, None, None, None]
    assert len(eager) == 20
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def tiny_model(*layers: str, checkpoint: str = "none"):
    cfg = fpscale.load_config(None, [*TINY, f"model.checkpoint={checkpoint}",
                                     "model.layers=[" + ", ".join(f"{{type: {t}}}" for t in layers) + "]"])
    torch.manual_seed(0)
    return fpscale.build_model(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["none", "block"])
def test_compiled_regions_have_no_graph_break(checkpoint):
    """An attn block (whole) and an fpsa block's MLP sublayer: each one graph, no break, forward and
    backward as eager (activation checkpointing inside the compiled block included). aot_eager:
    dynamo's graphs and AOTAutograd's backward without Inductor's C++ build (Inductor: the 20-step test)."""
    from torch._dynamo.utils import counters
    model = tiny_model("attn", "fpsa", checkpoint=checkpoint)
    eager = tiny_model("attn", "fpsa", checkpoint=checkpoint)
    assert apply_compile(model, "blocks", backend="aot_eager") == ["layers.0.forward", "layers.1.mlp_sublayer"]
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, 64, (2, 16))
    grads = []
    for m in (eager, model):
        loss = m(tokens, targets=tokens)
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2
    assert not model.layers[0].forward.failed and not model.layers[1].mlp_sublayer.failed
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_region_that_cannot_compile_says_which_and_runs_eager():
    model = tiny_model("attn")
    apply_compile(model, "blocks")
    block = model.layers[0]
    region = block.forward
    original = region.eager

    def breaks(x, pos=0, cache=None, pad=None):       # a host read: a graph break under fullgraph
        if x.sum().item() > 1e30:
            return x
        return original(x, pos, cache, pad)
    region.__init__(breaks, region.label)
    x = torch.randn(2, 16, 32)
    with pytest.warns(UserWarning, match=r"model.layers\[0\] \(AttnBlock\).forward does not compile"):
        out = block(x)
    torch.testing.assert_close(out, breaks(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # said once
        block(x)


def test_compile_key_is_validated():
    with pytest.raises(ConfigError, match="train.compile"):
        fpscale.load_config(None, ["train.compile=regions"])


@pytest.mark.slow
def test_epsilon_halting_step_compiles_once_for_every_depth():
    """epsilon under ``train.compile: blocks``: its halting step (block, halting head, update) is one
    graph for every step of the loop; 5 training steps that halt after 1, 3, 5, 2 and 8 steps (halting
    biases of -1e4 before that step and +1e4 at it) run with no graph break and no recompilation, and the
    gradients are eager's. aot_eager: dynamo's counters without Inductor's build."""
    from torch._dynamo.utils import counters
    model, eager = tiny_model("epsilon"), tiny_model("epsilon")
    assert apply_compile(model, "blocks", backend="aot_eager") == ["layers.0.halting_step"]
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for depth in (1, 3, 5, 2, 8):
        grads = []
        for m in (eager, model):
            with torch.no_grad():
                m.layers[0].b_halt.fill_(-1e4)              # no token halts before ...
                m.layers[0].b_halt[depth - 1] = 1e4          # ... this step, where all do
            m.zero_grad(set_to_none=True)
            m(tokens, targets=tokens).backward()
            assert m.layers[0].last_stats.iterations == depth
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert not model.layers[0].halting_step.failed
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
