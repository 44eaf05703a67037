"""DyLU: local steps proportional to worker speed."""

import math

import pytest

from diloco.algorithm import dylu_local_steps


def test_reference_vector() -> None:
    assert dylu_local_steps([1.0, 0.5, 0.26], 100) == [100, 50, 26]


def test_float_noise_does_not_lose_a_step() -> None:
    assert dylu_local_steps([1.0, 0.29], 100) == [100, 29]


def test_dict_in_dict_out_and_only_ratios_matter() -> None:
    assert dylu_local_steps({"fast": 2000.0, "slow": 500.0}, 8) == {"fast": 8, "slow": 2}


def test_very_slow_worker_still_gets_one_step() -> None:
    assert dylu_local_steps([1.0, 1e-6], 50) == [50, 1]


def test_empty_inputs() -> None:
    assert dylu_local_steps([], 10) == []
    assert dylu_local_steps({}, 10) == {}


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_speed_names_the_worker(bad: float) -> None:
    with pytest.raises(ValueError, match="worker 'b'"):
        dylu_local_steps({"a": 1.0, "b": bad}, 10)
    with pytest.raises(ValueError, match="worker index 1"):
        dylu_local_steps([1.0, bad], 10)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_sync_every(bad: int) -> None:
    with pytest.raises(ValueError, match="sync_every H must be an integer >= 1"):
        dylu_local_steps([1.0], bad)


def test_max_ratio_bounds_how_far_one_claimed_speed_can_shrink_the_others() -> None:
    # Reference speed min(max v, R * min v): min(1e6, 16 * 1) = 16, so the honest worker
    # runs floor(1 / 16 * 64) = 4 steps, not max(1, floor(1e-6 * 64)) = 1; the claimant 64.
    assert dylu_local_steps([1e6, 1.0], 64) == [64, 1]
    assert dylu_local_steps([1e6, 1.0], 64, max_ratio=16) == [64, 4]
    assert dylu_local_steps({"a": 1e6, "b": 2.0, "c": 1.0}, 64, 16) == {"a": 64, "b": 8, "c": 4}
    # Speeds within a factor R of each other are untouched (the paper's vector).
    assert dylu_local_steps([1.0, 0.5, 0.26], 100, max_ratio=16) == [100, 50, 26]


@pytest.mark.parametrize("bad", [0.5, math.nan, math.inf])
def test_bad_max_ratio(bad: float) -> None:
    with pytest.raises(ValueError, match="max_ratio"):
        dylu_local_steps([1.0], 10, max_ratio=bad)
