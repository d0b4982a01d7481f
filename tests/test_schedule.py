"""Learning-rate schedules are pure functions of the step."""

import math

import pytest

from muonrun.config import ScheduleConfig
from muonrun.train.schedule import lr_multiplier


def test_warmup_is_linear_from_zero():
    s = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_multiplier(k, s, 100) for k in (1, 5, 10)] == [0.1, 0.5, 1.0]


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_decays_reach_the_floor_at_max_steps(name):
    s = ScheduleConfig(name=name, warmup_steps=10, min_lr_ratio=0.1)
    values = [lr_multiplier(k, s, 100) for k in range(11, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # never increases
    assert values[-1] == pytest.approx(0.1)
    assert lr_multiplier(100 + 50, s, 100) == pytest.approx(0.1)  # past the end: stays at the floor


def test_cosine_midpoint():
    s = ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(50, s, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_constant_after_warmup():
    s = ScheduleConfig(name="constant", warmup_steps=4)
    assert [lr_multiplier(k, s, 20) for k in (2, 4, 5, 20)] == [0.5, 1.0, 1.0, 1.0]


def test_wsd_is_flat_then_decays_linearly():
    s = ScheduleConfig(name="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_multiplier(50, s, 100) == 1.0 and lr_multiplier(80, s, 100) == 1.0
    assert lr_multiplier(90, s, 100) == pytest.approx(0.5)
    assert lr_multiplier(100, s, 100) == pytest.approx(0.0)


def test_same_step_same_value():  # what makes a resumed run's schedule identical
    s = ScheduleConfig(name="cosine", warmup_steps=7, min_lr_ratio=0.05)
    assert [lr_multiplier(k, s, 300) for k in range(1, 300)] == [
        lr_multiplier(k, s, 300) for k in range(1, 300)
    ]
