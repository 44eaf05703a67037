"""staleness_scale: how much an async pseudo-gradient s outer steps old counts."""

from __future__ import annotations

import math

import pytest

from diloco.algorithm import staleness_scale


@pytest.mark.parametrize(("staleness", "scale"), [(0, 1.0), (1, 1 / math.sqrt(2)), (3, 0.5)])
def test_inverse_sqrt_is_one_over_the_root_of_one_plus_staleness(
    staleness: int, scale: float
) -> None:
    assert staleness_scale(staleness, "inverse_sqrt") == pytest.approx(scale, rel=1e-12)


def test_none_keeps_every_pseudo_gradient_whole() -> None:
    assert [staleness_scale(s, "none") for s in (0, 1, 100)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("staleness", "weighting", "message"),
    [
        (1, "log", "staleness weighting must be one of 'none', 'inverse_sqrt', got 'log'"),
        (-1, "inverse_sqrt", "staleness must be >= 0, got -1"),
    ],
)
def test_bad_input_is_a_value_error_naming_it(staleness: int, weighting: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        staleness_scale(staleness, weighting)
