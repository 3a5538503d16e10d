"""The pooled classification head (fpscale.models.classify) over any layer type."""
import pytest
import torch
import torch.nn.functional as F

from fpscale.errors import ConfigError
from fpscale.models.classify import PooledClassifier
from tests.models.helpers import tiny_model


@pytest.mark.parametrize("layer_type,pool", [("attn", "mean"), ("epsilon", "last"), ("fpsa", "mean")])
def test_a_left_padded_row_is_classified_as_the_row_alone(layer_type, pool):
    clf = PooledClassifier(tiny_model(layer_type, dtype=torch.float64), 2, pool).double().eval()
    g = torch.Generator().manual_seed(0)
    row = torch.randint(0, 32, (1, 7), generator=g)
    other = torch.randint(0, 32, (1, 10), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1), other])
    with torch.no_grad():
        alone, padded = clf(row), clf(batch, pad=torch.tensor([3, 0]))
    assert torch.allclose(padded[0], alone[0], rtol=0, atol=1e-6)
    # mean pooling is the mean of the hidden states over the real tokens
    if pool == "mean":
        with torch.no_grad():
            want = clf.proj(clf.lm.hidden(row).mean(1))
        assert torch.allclose(alone, want)


def test_the_loss_carries_the_looped_layers_auxiliary_loss_and_trains_every_part():
    clf = PooledClassifier(tiny_model("epsilon"), 2).train()
    clf.lm.set_step(0)          # the power iteration advances once for the step, not per forward
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 1, 0])
    loss = clf.loss(tokens, labels)
    ce = F.cross_entropy(clf(tokens), labels)
    aux = clf.lm.aux_loss()
    assert aux is not None and torch.allclose(loss, ce + aux)
    loss.backward()
    assert clf.proj.weight.grad.abs().sum() > 0 and clf.lm.embed.weight.grad.abs().sum() > 0


def test_bad_arguments_name_the_key():
    with pytest.raises(ConfigError, match="pool"):
        PooledClassifier(tiny_model("attn"), 2, "max")
