"""RetryPolicy: exponential waits, capped, jittered within bounds, validated by field."""

from __future__ import annotations

import itertools
import random

import pytest

from diloco.worker import RetryPolicy


def test_without_jitter_waits_double_from_base_up_to_the_cap() -> None:
    policy = RetryPolicy(attempts=8, base_delay=0.5, max_delay=10.0, jitter=0.0)
    assert list(policy.delays()) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_attempts_counts_the_first_try() -> None:
    assert list(RetryPolicy(attempts=1).delays()) == []
    assert len(list(RetryPolicy(attempts=4).delays())) == 3


def test_forever_keeps_yielding_capped_waits_without_overflow() -> None:
    policy = RetryPolicy(attempts=None, base_delay=1.0, max_delay=30.0, jitter=0.0)
    waits = list(itertools.islice(policy.delays(), 5000))
    assert len(waits) == 5000
    assert waits[-1] == 30.0


@pytest.mark.parametrize("jitter", [0.25, 0.5, 1.0])
def test_jitter_keeps_each_wait_within_its_fraction_of_the_ceiling(jitter: float) -> None:
    policy = RetryPolicy(attempts=12, base_delay=0.1, max_delay=3.0, jitter=jitter)
    ceilings = [min(3.0, 0.1 * 2**n) for n in range(11)]
    waits = list(policy.delays(random.Random(3)))
    for wait, ceiling in zip(waits, ceilings, strict=True):
        assert ceiling * (1 - jitter) <= wait <= ceiling
    assert len(set(waits)) == len(waits)  # the jitter is really random


def test_an_injected_rng_makes_the_waits_reproducible() -> None:
    policy = RetryPolicy(attempts=6, jitter=1.0)
    assert list(policy.delays(random.Random(7))) == list(policy.delays(random.Random(7)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"attempts": 0}, "attempts"),
        ({"attempts": 2.0}, "attempts"),
        ({"attempts": True}, "attempts"),
        ({"base_delay": -1.0}, "base_delay"),
        ({"base_delay": float("nan")}, "base_delay"),
        ({"base_delay": 5.0, "max_delay": 1.0}, "max_delay"),
        ({"max_delay": float("inf")}, "max_delay"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"deadline": 0.0}, "deadline"),
        ({"deadline": "10"}, "deadline"),
        ({"first_contact": 0}, "first_contact"),
        ({"first_contact": float("inf")}, "first_contact"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"RetryPolicy\.{field}\b"):
        RetryPolicy(**kwargs)
