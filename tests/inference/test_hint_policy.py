"""The lookahead's precision governor (inference.experts.hint_policy), alone: no torch, no model."""

from __future__ import annotations

import ast
import sys

import pytest

from inference.experts import hint_policy
from inference.experts.hint_policy import (
    BATCHED,
    BATCHED_MAX_TOKENS,
    CHUNK,
    SINGLE,
    HintPolicy,
    width_bucket,
)


@pytest.mark.parametrize("tokens, bucket", [
    (1, SINGLE), (2, BATCHED), (8, BATCHED), (BATCHED_MAX_TOKENS, BATCHED), (BATCHED_MAX_TOKENS + 1, CHUNK),
    (512, CHUNK),
])
def test_width_buckets(tokens, bucket):
    assert width_bucket(tokens) == bucket


def test_width_bucket_refuses_an_empty_step():
    with pytest.raises(ValueError, match="at least one token"):
        width_bucket(0)


@pytest.mark.parametrize("kwargs, problem", [
    ({"min_precision": -0.1}, "min_precision"), ({"min_precision": 1.5}, "min_precision"),
    ({"min_precision": True}, "min_precision"), ({"min_precision": 0.5, "alpha": 0.0}, "alpha"),
    ({"min_precision": 0.5, "alpha": 1.5}, "alpha"), ({"min_precision": 0.5, "warmup": -1}, "warmup"),
])
def test_bad_parameters_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        HintPolicy(**kwargs)


def step(policy: HintPolicy, predicted, used, *, layer: int = 3, tokens: int = 1) -> bool:
    """One layer's prediction for `layer`, then `layer`'s actual experts; whether it was sent."""
    sent = policy.predicted(layer, tokens, predicted)
    policy.observe(layer, tokens, used)
    return sent


# (predictions [(predicted, used)], alpha, expected running precision)
PRECISION_CASES = {
    "first observation seeds the mean": ([([1, 2, 3, 4], [1, 2, 9])], 0.1, 0.5),
    "all used": ([([1, 2], [1, 2, 3])], 0.1, 1.0),
    "none used": ([([1, 2], [3, 4])], 0.1, 0.0),
    "weighted by alpha": ([([1, 2], [1, 2]), ([1, 2], [5])], 0.1, 0.9),
    "alpha 1 keeps only the newest": ([([1, 2], [1, 2]), ([1, 2, 3, 4], [4])], 1.0, 0.25),
    "three steps": ([([1], [1]), ([1], [2]), ([1, 2], [2])], 0.5, 0.5),  # 1 -> 0.5 -> 0.5
}


@pytest.mark.parametrize("name", list(PRECISION_CASES))
def test_precision_arithmetic(name):
    steps, alpha, expected = PRECISION_CASES[name]
    policy = HintPolicy(0.5, alpha=alpha)
    for predicted, used in steps:
        step(policy, predicted, used)
    stats = policy.stats()
    assert stats.buckets[SINGLE].precision == pytest.approx(expected)
    assert stats.buckets[SINGLE].observations == len(steps)


def test_buckets_are_kept_apart():
    policy = HintPolicy(0.5, warmup=2)
    for _ in range(2):
        step(policy, [1, 2, 3, 4], [1], tokens=1)  # 0.25
        step(policy, [1, 2, 3, 4], [1, 2, 3], tokens=8)  # 0.75
        step(policy, [1, 2], [1, 2], tokens=64)  # 1.0
    buckets = policy.stats().buckets
    assert [buckets[b].precision for b in (SINGLE, BATCHED, CHUNK)] == [0.25, 0.75, 1.0]
    assert [policy.should_send(tokens) for tokens in (1, 8, 64)] == [False, True, True]


def test_optimistic_until_warmup_then_withheld_below_the_threshold():
    policy = HintPolicy(0.5, warmup=8)
    sent = [step(policy, [1, 2, 3, 4], [1]) for _ in range(10)]  # precision 0.25 throughout
    assert sent == [True] * 8 + [False] * 2
    stats = policy.stats()
    assert (stats.hints_sent, stats.hinted_experts, stats.withheld) == (8, 32, 2)
    assert not stats.buckets[SINGLE].sending and stats.buckets[BATCHED].sending  # others still optimistic


def test_withheld_predictions_are_still_scored_and_hints_come_back():
    policy = HintPolicy(0.5, alpha=0.5, warmup=2)
    assert [step(policy, [1, 2, 3, 4], [1]) for _ in range(3)] == [True, True, False]  # 0.25
    # the predictor improves while its hints are withheld: shadow scores lift the mean
    recovered = [step(policy, [1, 2], [1, 2]) for _ in range(3)]  # 0.625, 0.8125, ...
    assert recovered == [False, True, True]
    stats = policy.stats()
    assert stats.withheld == 2 and stats.buckets[SINGLE].observations == 6


@pytest.mark.parametrize("min_precision, sends", [(0.0, True), (0.2, True), (0.5, False), (1.0, False)])
def test_threshold(min_precision, sends):
    policy = HintPolicy(min_precision, warmup=1)
    step(policy, [1, 2, 3, 4], [1, 7])  # precision 0.25
    assert policy.should_send(1) is sends


def test_min_precision_zero_always_sends_and_still_scores():
    policy = HintPolicy(0.0, warmup=0)
    assert all(step(policy, [1, 2, 3], [9]) for _ in range(20))
    stats = policy.stats()
    assert stats.withheld == 0 and stats.hints_sent == 20 and stats.buckets[SINGLE].precision == 0.0


@pytest.mark.parametrize("case", ["no prediction", "prediction of another width", "scored once"])
def test_observations_without_a_matching_prediction_are_not_scored(case):
    policy = HintPolicy(0.5)
    if case == "prediction of another width":
        policy.predicted(3, 4, [1, 2])
    elif case == "scored once":
        step(policy, [1, 2], [1, 2])
    policy.observe(3, 1, [5])
    expected = 1 if case == "scored once" else 0
    assert policy.stats().buckets[SINGLE].observations == expected


def test_predictions_are_remembered_per_layer_and_replaced_when_unscored():
    policy = HintPolicy(0.5, alpha=1.0)
    policy.predicted(2, 1, [1, 2])
    policy.predicted(3, 1, [5, 6])
    policy.predicted(3, 1, [7, 8])  # layer 3 was not scored in between (e.g. it ran off the host path)
    policy.observe(3, 1, [7, 8])
    assert policy.stats().buckets[SINGLE].precision == 1.0
    policy.observe(2, 1, [9])
    assert policy.stats().buckets[SINGLE].precision == 0.0


def test_an_empty_prediction_is_neither_sent_nor_withheld():
    policy = HintPolicy(0.5)
    assert policy.predicted(3, 1, []) is False
    policy.observe(3, 1, [1])
    stats = policy.stats()
    assert (stats.hints_sent, stats.withheld, stats.buckets[SINGLE].observations) == (0, 0, 0)


def test_the_policy_is_plain_python():
    tree = ast.parse(open(hint_policy.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
