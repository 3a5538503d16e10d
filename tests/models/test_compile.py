"""``solver.compile``: the iteration step under torch.compile equals the eager one, and a solve
of another length does not recompile it (the loop is Python, the step one graph)."""
import pytest
import torch

from tests.models.helpers import tiny_model


def solved_layer(model, layer_type):
    """The module that runs the solve (holds ``solver`` and ``last_stats``)."""
    layer = model.layers[0]
    return {"fpmamba": lambda: layer.mixer, "fpsa": lambda: layer.attn}.get(layer_type, lambda: layer)()


@pytest.mark.slow
@pytest.mark.parametrize("layer_type", ["fpmamba", "looped", "fpsa"])
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
            loop = solved_layer(model, layer_type)
            loop.solver.forward.max_iter = loop.solver.forward.eval_max_iter = 7       # another iteration count
            with torch.no_grad():
                layer(x)
            assert loop.last_stats.iterations == 7
            assert counters["stats"]["unique_graphs"] == graphs     # nothing recompiled
    assert torch.allclose(outs[True], outs[False], atol=1e-5)


@pytest.mark.slow
def test_compiled_fpsa_implicit_gradient_matches_eager():
    """fpsa trains with the implicit backward: the solve's iterations run compiled, the one
    application of f the adjoint differentiates stays eager (fixed_point.compiled), and the
    output and every gradient equal the eager layer's."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    x = torch.randn(2, 8, 32)
    got = {}
    for compile_ in (False, True):
        model = tiny_model("fpsa", solver={"tol": 1e-4, "max_iter": 30, "compile": compile_, "backward": "implicit",
                                           "backward_tol": 1e-6, "backward_max_iter": 50,
                                           "freeze_converged": True}).train()
        layer = model.layers[0]
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.pow(2).mean().backward()
        assert layer.attn.last_stats.backward_iterations >= 2
        got[compile_] = {"out": out.detach(), "x": xi.grad, **{k: p.grad for k, p in layer.named_parameters()}}
        if compile_:
            assert counters["stats"]["unique_graphs"] == before + 1      # the no-grad step only
    for name, eager in got[False].items():
        assert torch.allclose(got[True][name], eager, atol=1e-5), name
