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
