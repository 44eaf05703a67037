"""The grace-window rule that the server's async engine and the simulator both call."""

from __future__ import annotations

import pytest

from diloco.algorithm import GraceWindow


def test_a_window_takes_arrivals_up_to_its_fixed_deadline() -> None:
    window = GraceWindow(2.0)  # opened at t = 10: the deadline is 12 whatever arrives later
    assert window.deadline(10.0) == 12.0
    assert window.takes(10.0, 11.5) and window.takes(10.0, 12.0)
    assert not window.takes(10.0, 12.01)


def test_it_closes_at_the_deadline_or_at_the_last_arrival_once_everyone_has_arrived() -> None:
    window = GraceWindow(2.0)
    assert window.closes_at(10.0, 11.0, all_arrived=False) == 12.0
    assert window.closes_at(10.0, 11.0, all_arrived=True) == 11.0
    assert not window.closed(10.0, 11.0, all_arrived=False, now=11.9)
    assert window.closed(10.0, 11.0, all_arrived=False, now=12.0)
    assert window.closed(10.0, 11.0, all_arrived=True, now=11.0)


def test_no_grace_is_no_window() -> None:
    window = GraceWindow(0.0)
    assert not window.takes(10.0, 10.0)  # even a simultaneous arrival is its own step
    assert window.closes_at(10.0, 10.0, all_arrived=False) == 10.0
    assert window.closed(10.0, 10.0, all_arrived=False, now=10.0)


@pytest.mark.parametrize("grace", [-1.0, float("inf"), float("nan")])
def test_a_grace_outside_zero_to_infinity_is_refused(grace: float) -> None:
    with pytest.raises(ValueError, match="grace must be a number >= 0"):
        GraceWindow(grace)
