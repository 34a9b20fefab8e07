"""The CPU experts' share tuner (inference/experts/share_tuner.py) against step-time curves: it
finds the fastest level from either side, stops at the ends, stays put on a flat curve and on
outliers, and follows a curve that changes once it probes again."""

from __future__ import annotations

import random

import pytest

from inference.experts.share_tuner import SETTLED, ShareTuner


def drive(tuner: ShareTuner, seconds_at, steps: int, noise: float = 0.0, seed: int = 0) -> list[int]:
    """Feed `steps` step times (seconds_at(level), times 1 +- noise); the level at each step."""
    rng = random.Random(seed)
    levels = []
    for _ in range(steps):
        tuner.observe(seconds_at(tuner.level) * (1 + rng.uniform(-noise, noise)))
        levels.append(tuner.level)
    return levels


def valley(best: int, slope: float = 0.03):
    return lambda level: 1e-3 * (1 + slope * abs(level - best))


@pytest.mark.parametrize("start, best, levels", [
    (6, 10, 16),   # the fastest share above the start
    (6, 2, 16),    # below it
    (6, 6, 16),    # at it: one probe each way, back
    (6, 0, 16),    # the CPU is no help: down to none
    (6, 16, 16),   # the CPU takes every host-tier expert
    (1, 3, 4),
])
def test_it_settles_at_the_fastest_level(start, best, levels):
    tuner = ShareTuner(level=start, levels=levels, window=8)
    trace = drive(tuner, valley(best), steps=8 * (abs(best - start) + 4), noise=0.005)
    assert tuner.state == SETTLED and tuner.level == best
    assert all(0 <= level <= levels for level in trace)
    assert max(trace) <= max(start, best) + 1 and min(trace) >= min(start, best) - 1  # one level past at most


def test_a_flat_curve_keeps_the_level():
    tuner = ShareTuner(level=6, window=8, margin=0.02)
    drive(tuner, lambda level: 1e-3, steps=8 * 40, noise=0.005)  # noise well inside the margin
    assert tuner.level == 6


def test_outliers_do_not_move_it():
    """A step redone on the acquire path (ten times as long) in every window: medians ignore it."""
    tuner = ShareTuner(level=6, window=8)
    count = 0

    def seconds_at(level):
        nonlocal count
        count += 1
        return 1e-2 if count % 8 == 3 else valley(6)(level)

    drive(tuner, seconds_at, steps=8 * 40)
    assert tuner.level == 6


def test_it_probes_again_after_settling_and_follows_a_change():
    tuner = ShareTuner(level=6, window=4, settle=3)
    drive(tuner, valley(9), steps=4 * 10)
    assert tuner.level == 9 and tuner.state == SETTLED
    drive(tuner, valley(4), steps=4 * 20)  # the host got busier: less for the CPU
    assert tuner.level == 4


def test_observe_returns_each_new_level():
    tuner = ShareTuner(level=6, window=2)
    changes = [tuner.observe(1e-3) for _ in range(2)]
    assert changes == [None, 7]  # the first window measured the base, then a probe up


def test_starting_share_rounds_to_a_level():
    assert ShareTuner.starting_at(0.35).level == 6 and ShareTuner.starting_at(0.35).share == 0.375
    assert ShareTuner.starting_at(1.0, levels=8).level == 8


@pytest.mark.parametrize("kwargs", [dict(level=17), dict(level=-1), dict(level=1, levels=0),
                                    dict(level=1, window=0), dict(level=1, margin=1.0), dict(level=1, settle=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="share tuner"):
        ShareTuner(**kwargs)
