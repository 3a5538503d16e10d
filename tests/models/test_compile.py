"""``solver.compile``: the iteration step under torch.compile equals the eager one, and a solve
of another length does not recompile it (the loop is Python, the step one graph)."""
import pytest
import torch

from tests.models.helpers import tiny_model


@pytest.mark.slow
@pytest.mark.parametrize("layer_type", ["fpmamba", "looped"])
def test_compiled_step_matches_eager_and_never_recompiles_for_another_iteration_count(layer_type):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    x = torch.randn(2, 8, 32)
    outs = {}
    for compile_ in (False, True):
        model = tiny_model(layer_type, solver={"tol": 0.0, "max_iter": 3, "compile": compile_}).eval()
        layer = model.layers[0]
        with torch.no_grad():
            outs[compile_] = layer(x)
        if compile_:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 1
            loop = layer.mixer if layer_type == "fpmamba" else layer
            loop.solver.max_iter = loop.solver.eval_max_iter = 7       # another iteration count
            with torch.no_grad():
                layer(x)
            assert loop.last_stats.iterations == 7
            assert counters["stats"]["unique_graphs"] == graphs     # nothing recompiled
    assert torch.allclose(outs[True], outs[False], atol=1e-5)
