"""Blends: the weighted order over global positions (fractions, epochs of a small source, a
position's sample depends on the position alone), and the config-load checks of the sources
(one tokenizer, a Megatron source names its own, model.vocab_size holds the vocabulary). The
DP-union and resume guarantees are tests/data/test_loader.py's, run on a blend too; a training
run on a blend: tests/train/test_blend_run.py."""
import numpy as np
import pytest

import fpscale
from fpscale.data.blend import BLOCK, BlendOrder, open_blend
from fpscale.errors import ConfigError
from tests.data.conftest import blend_config

BASE = ["data.seq_len=16", "model.max_seq_len=32", "model.vocab_size=512"]


def test_fractions_follow_the_weights_over_10000_samples():
    order = BlendOrder([37, 900, 5000], [0.5, 0.3, 0.2], seed=3)
    rows = order.indices(0, 10_000)
    counts = np.bincount(rows[:, 0], minlength=3)
    for count, w in zip(counts, (0.5, 0.3, 0.2)):     # within 3 standard errors of a binomial draw
        assert abs(count / 10_000 - w) < 3 * np.sqrt(w * (1 - w) / 10_000), counts
    whole = 9 * BLOCK                                  # whole blocks: each share to within one sample
    assert np.all(np.abs(np.bincount(rows[:whole, 0], minlength=3) - np.array([0.5, 0.3, 0.2]) * whole) <= 1)
    first = rows[:BLOCK]
    for s, n in ((1, 900), (2, 5000)):                 # fewer slots than samples: no sample twice in an epoch
        assert len(set(first[first[:, 0] == s, 1])) == (first[:, 0] == s).sum() and first[first[:, 0] == s, 1].max() < n


def test_a_small_source_wraps_its_epochs_without_disturbing_the_others():
    """Source 0 (37 samples) runs through one permutation per epoch, a new one each epoch; the
    other sources' samples are the same as in a blend where source 0 is larger."""
    rows = BlendOrder([37, 900, 5000], [0.5, 0.3, 0.2], seed=3).indices(0, 4000)
    small = rows[rows[:, 0] == 0, 1]
    epochs = small[: len(small) // 37 * 37].reshape(-1, 37)
    assert len(epochs) >= 50 and all(sorted(e) == list(range(37)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == len(epochs)
    bigger = BlendOrder([400, 900, 5000], [0.5, 0.3, 0.2], seed=3).indices(0, 4000)
    assert np.array_equal(bigger[:, 0], rows[:, 0])
    assert np.array_equal(bigger[rows[:, 0] > 0], rows[rows[:, 0] > 0])


def test_a_position_reads_the_same_sample_from_wherever_the_stream_is_read():
    order = BlendOrder([37, 900, 5000], [0.5, 0.3, 0.2], seed=3)
    rows = order.indices(0, 3 * BLOCK)
    fresh = BlendOrder([37, 900, 5000], [0.5, 0.3, 0.2], seed=3)        # no cached block
    for start, count in ((BLOCK - 5, 10), (1500, 700), (2 * BLOCK + 1, 3)):
        assert np.array_equal(fresh.indices(start, count), rows[start:start + count])
    assert not np.array_equal(BlendOrder([37, 900, 5000], [0.5, 0.3, 0.2], seed=4).indices(0, 64), rows[:64])


def test_a_tiny_weight_still_gets_its_share():
    rows = BlendOrder([10, 10], [0.999, 0.001], seed=0).indices(0, 20 * BLOCK)
    assert abs(int((rows[:, 0] == 1).sum()) - 20 * BLOCK * 0.001) <= 1


def test_the_fingerprint_covers_every_source_and_weight(blend_sources):
    base = open_blend(blend_config(blend_sources))[0].fingerprint()
    assert open_blend(blend_config(blend_sources, (0.5, 0.2, 0.3)))[0].fingerprint() != base
    assert open_blend(blend_config(blend_sources[:2], (0.5, 0.3)))[0].fingerprint() != base
    assert open_blend(blend_config(blend_sources, seq_len=8))[0].fingerprint() != base
    assert open_blend(blend_config(blend_sources))[0].fingerprint() == base


def test_sources_prepared_with_other_tokenizers_are_refused_at_config_load(blend_sources, hf_prepared, capsys):
    blend = f"data.blend=[{{path: {blend_sources[0]}, weight: 0.7}}, {{path: {hf_prepared}, weight: 0.3}}]"
    with pytest.raises(ConfigError, match=r"config key 'data.blend.1': .*hfprep.*/out was prepared with the "
                                          r"tokenizer .*tokenizer.json .*data.blend.0 .*with .*tokenizer.model"):
        fpscale.load_config("configs/tiny_attn.yaml", [*BASE, blend])
    from fpscale.cli.pretrain import main
    assert main(["--config", "configs/tiny_attn.yaml", *BASE, blend]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json" in err and "tokenizer.model" in err


def test_config_load_checks_the_vocabulary_and_names_a_megatron_tokenizer(blend_sources, megatron_prefixes):
    with pytest.raises(ConfigError, match=r"'model.vocab_size': 64 is smaller than the 320 pieces"):
        fpscale.load_config("configs/tiny_attn.yaml", [*BASE, "model.vocab_size=64",
                                                       f"data.blend=[{{path: {blend_sources[0]}, weight: 1}}]"])
    prefix = megatron_prefixes["uint16"][0]
    with pytest.raises(ConfigError, match=r"'data.blend.1.tokenizer': .* records no tokenizer"):
        fpscale.load_config("configs/tiny_attn.yaml", [*BASE, f"data.blend=[{{path: {blend_sources[0]}, weight: 1}},"
                                                              f" {{path: {prefix}, weight: 1}}]"])
    with pytest.raises(ConfigError, match=r"'data.blend.0.weight': must be > 0, got 0.0"):
        fpscale.load_config("configs/tiny_attn.yaml", [*BASE, f"data.blend=[{{path: {prefix}, weight: 0}}]"])
    with pytest.raises(ConfigError, match=r"'data.blend.1.name': 'a' names two sources"):
        fpscale.load_config("configs/tiny_attn.yaml", [*BASE, "data.blend=[{path: x, weight: 1, name: a}, "
                                                              "{path: y, weight: 1, name: a}]"])
