"""The learning-rate schedule: linear warm-up to lr, then cosine decay to min_lr at train.steps."""
import math

import pytest

from fpscale.train.schedule import lr_at

LR, MIN_LR, WARMUP, TOTAL = 1.0, 0.1, 4, 20


def test_warmup_rises_linearly_to_lr():
    assert [lr_at(s, LR, MIN_LR, WARMUP, TOTAL) for s in range(WARMUP)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_from_lr_to_min_lr_at_the_last_step():
    assert lr_at(WARMUP, LR, MIN_LR, WARMUP, TOTAL) == LR
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_at(middle, LR, MIN_LR, WARMUP, TOTAL) == pytest.approx((LR + MIN_LR) / 2)
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    cosine_quarter = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / 4)) / 2
    assert lr_at(quarter, LR, MIN_LR, WARMUP, TOTAL) == pytest.approx(cosine_quarter)
    assert lr_at(TOTAL, LR, MIN_LR, WARMUP, TOTAL) == pytest.approx(MIN_LR)
    assert lr_at(TOTAL + 5, LR, MIN_LR, WARMUP, TOTAL) == pytest.approx(MIN_LR)      # stays at the floor
    decay = [lr_at(s, LR, MIN_LR, WARMUP, TOTAL) for s in range(WARMUP, TOTAL + 1)]
    assert decay == sorted(decay, reverse=True)


def test_without_warmup_the_first_step_runs_at_lr():
    assert lr_at(0, LR, MIN_LR, 0, TOTAL) == LR
    assert lr_at(TOTAL // 2, LR, MIN_LR, 0, TOTAL) == pytest.approx((LR + MIN_LR) / 2)


# -- train.schedule: constant and wsd; Muon's momentum warm-up ------------------------------------------
from fpscale.train.schedule import momentum_at  # noqa: E402


def test_constant_holds_lr_after_warmup():
    assert [lr_at(s, LR, MIN_LR, WARMUP, TOTAL, "constant") for s in (0, WARMUP, TOTAL - 1, TOTAL)] == \
        [0.25, LR, LR, LR]


def test_wsd_is_stable_then_decays_the_last_fraction_to_the_floor():
    # 20 steps, decay 0.25: stable through step 14, decay over steps 15..20
    wsd = [lr_at(s, LR, MIN_LR, WARMUP, TOTAL, "wsd", 0.25, "linear") for s in range(TOTAL + 2)]
    assert wsd[:WARMUP] == [0.25, 0.5, 0.75, 1.0]
    assert wsd[WARMUP:15] == [LR] * (15 - WARMUP)
    assert wsd[15:21] == pytest.approx([MIN_LR + (LR - MIN_LR) * (1 - k / 5) for k in range(6)])
    assert wsd[21] == pytest.approx(MIN_LR)
    sqrt = [lr_at(s, LR, MIN_LR, WARMUP, TOTAL, "wsd", 0.25, "1-sqrt") for s in range(15, 21)]
    assert sqrt == pytest.approx([MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(k / 5)) for k in range(6)])
    assert all(a <= b for a, b in zip(sqrt[1:-1], wsd[16:20]))      # 1-sqrt drops faster first


def test_momentum_warmup_rises_linearly_then_holds():
    assert [momentum_at(s, 0.95, 0.85, 4) for s in (0, 2, 4, 100)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert momentum_at(0, 0.95, 0.85, 0) == 0.95


def test_wsd_that_does_not_fit_names_the_key():
    import fpscale
    from fpscale.errors import ConfigError
    with pytest.raises(ConfigError, match="train.decay_fraction.*exceed train.steps"):
        fpscale.load_config(None, ["train.schedule=wsd", "train.steps=10", "train.warmup=5",
                                   "train.decay_fraction=0.8"])
    with pytest.raises(ConfigError, match="train.decay_fraction"):
        fpscale.load_config(None, ["train.schedule=wsd", "train.decay_fraction=0"])
    with pytest.raises(ConfigError, match="train.decay_shape"):
        fpscale.load_config(None, ["train.decay_shape=cosine"])
