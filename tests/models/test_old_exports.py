"""Exports made before the house moved (tests/fixtures/premove_export, commit f8129cb) load with today's
code and compute the same function; code written against the old module paths still imports."""
import warnings
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "premove_export"


def test_an_export_from_before_the_move_loads_and_gives_its_logits():
    import dataclasses

    from fpscale.train.checkpoint import load_model
    model, _ = load_model(str(FIXTURE))
    model = model.double().eval()
    # the fixture's logits were computed before issue 36 changed what evaluation computes (z*, not the
    # jfb/phantom step; per-sample damping): the old rules reproduce them, so the move changed nothing
    for layer in model.fixed_point_layers().values():
        layer.solver = dataclasses.replace(layer.solver, eval_output="iterate", decisions="sample")
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    with torch.no_grad():
        logits = model(expected["tokens"])
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("old, new, name", [
    ("fpscale.models.fpsa", "fpscale.layers.fpsa", "FPSASpec"),
    ("fpscale.models.registry", "fpscale.layers.registry", "register_layer"),
    ("fpscale.models.scan_triton", "fpscale.ops.scan_triton", "DEFAULT_CHUNK"),
    ("fpscale.models.chunked_loss", "fpscale.ops.chunked_loss", "chunked_cross_entropy"),
])
def test_old_module_paths_import_with_a_warning_naming_the_new_one(old, new, name):
    import importlib
    import sys
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_old_common_module_finds_each_name_where_it_went():
    import sys
    sys.modules.pop("fpscale.models.common", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from fpscale.models.common import LMHead, RMSNorm, causal_attention
    from fpscale.layers.common import RMSNorm as new_norm
    from fpscale.models.heads import LMHead as new_head
    from fpscale.ops.attention import causal_attention as new_attention
    assert (LMHead, RMSNorm, causal_attention) == (new_head, new_norm, new_attention)
    old = sys.modules["fpscale.models.common"]
    with pytest.raises(AttributeError, match="moved to fpscale.layers.common, fpscale.ops.attention"):
        old.no_such_name
