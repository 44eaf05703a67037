"""Async mode in the coordinator (no HTTP): arrivals applied at once with Delayed Nesterov,
the grace window, staleness, idempotency across restarts, and DyLU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from crashes import killed
from test_server_coordinator import W_SPEC, FakeClock, grad, rejected, scalar

from diloco.server.coordinator import Coordinator, RoundResult, Waiting
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import decode_tensors

DN = {"mode": "async", "outer_lr": 0.7, "outer_momentum": 0.9}


def asynchronous(
    workers=("a", "b"), base: float | None = 1.0, state_dir: Path | None = None, **settings
) -> tuple[Coordinator, FakeClock]:
    clock = FakeClock()
    config = ServerSettings(**{**DN, **settings})
    journal = RoundJournal(StateStore(state_dir), config) if state_dir is not None else None
    initial = None if base is None else {"w": scalar(base)}
    c = Coordinator(config, initial, clock=clock, journal=journal)
    for worker in workers:
        c.register(worker, W_SPEC, protocol_version=1)
    return c, clock


def w_of(c: Coordinator) -> float:
    assert c.masters is not None
    return c.masters["w"].item()


def result_w(c: Coordinator, version: int, worker: str) -> tuple[float, int]:
    answer = c.wait_result(version, worker, 0)
    assert isinstance(answer, RoundResult), answer
    return decode_tensors(answer.body)["w"].item(), answer.round


def test_each_arrival_is_one_delayed_nesterov_step() -> None:
    """DESIGN.md: N = 2, beta 0.9, lr 0.7, theta0 = 1, g = [0.2, 0.4, 0.2, 0.4] gives
    [0.93, 0.601, 0.531, 0.0319]; with c = 0.1, [0.93, 0.6199, 0.531, 0.06781]."""
    for c_value, expected in (
        (0.0, [0.93, 0.601, 0.531, 0.0319]),
        (0.1, [0.93, 0.6199, 0.531, 0.06781]),
    ):
        c, _ = asynchronous(workers=("a",), dn_period=2, dn_c=c_value)
        seen = []
        for version, g in enumerate([0.2, 0.4, 0.2, 0.4]):
            answer = c.submit("a", version, grad(g))
            assert (answer["status"], answer["applied_version"], answer["staleness"]) == (
                "accepted",
                version,
                0,
            )
            w, new_version = result_w(c, version, "a")
            assert new_version == version + 1 == c.version
            seen.append(w)
        assert seen == pytest.approx(expected, abs=1e-6)
    assert c.info()["settings"]["outer_optimizer"] == {
        "kind": "delayed_nesterov",
        "lr": 0.7,
        "momentum": 0.9,
        "delay": 2,
        "c": 0.1,
    }


def test_staleness_is_recorded_and_can_scale_a_stale_pseudo_gradient() -> None:
    c, _ = asynchronous(outer_optimizer="nesterov", dn_period=1, staleness_weighting="inverse_sqrt")
    c.submit("a", 0, grad(0.1))
    c.submit("a", 1, grad(0.1))
    before = w_of(c)
    momentum = c.model.optimizer.state_dict()["momentum/w"].item()
    answer = c.submit("b", 0, grad(0.3))  # b's anchor is version 0: two steps old
    assert answer["staleness"] == 2
    g = 0.3 / math.sqrt(3.0)
    buf = 0.9 * momentum + g
    assert w_of(c) == pytest.approx(before - 0.7 * (g + 0.9 * buf), abs=1e-6)
    rows = c.journal.state.submissions_of(2)
    assert rows == [{"worker_id": "b", "round": 0, "fragment": 0, "staleness": 2}]


def test_a_retry_is_applied_once_even_after_a_restart(tmp_path: Path) -> None:
    c, _ = asynchronous(state_dir=tmp_path)
    c.submit("a", 0, grad(0.2))
    after_one = w_of(c)
    again = c.submit("a", 0, grad(0.2))
    assert (again["status"], again["applied_version"]) == ("duplicate", 0)
    assert w_of(c) == after_one and c.version == 1
    killed(c)
    restarted, _ = asynchronous(workers=(), base=None, state_dir=tmp_path)
    assert restarted.version == 1 and w_of(restarted) == after_one
    retry = restarted.submit("a", 0, grad(0.2))
    assert (retry["status"], retry["applied_version"]) == ("duplicate", 0)
    assert result_w(restarted, 0, "a") == (after_one, 1)
    assert w_of(restarted) == after_one and restarted.version == 1
    # b never sent anything for version 0: told to send it.
    rejected(restarted, lambda: restarted.wait_result(0, "b", 0), 409, "not_submitted")


def test_the_grace_window_averages_arrivals_and_its_deadline_does_not_slide() -> None:
    c, clock = asynchronous(
        workers=("a", "b", "c"), outer_optimizer="nesterov", outer_lr=1.0, grace_seconds=5
    )
    c.submit("a", 0, grad(0.2))
    assert c.version == 0 and c.wait_result(0, "a", 0) == Waiting(0, ["b", "c"])
    clock.advance(4.9)
    c.submit("b", 0, grad(0.4))  # inside the window
    assert c.version == 0
    clock.advance(0.2)  # 5.1 s after the first arrival: the window closes, c or not
    w, version = result_w(c, 0, "a")
    assert version == 1 and result_w(c, 0, "b") == (w, 1)  # identical weights for both
    # One Nesterov step (momentum 0.9, lr 1) on the mean 0.3: 1 - (0.3 + 0.9 * 0.3).
    assert w == pytest.approx(1 - 0.57)
    assert c.journal.state.submissions_of(0) == [
        {"worker_id": "a", "round": 0, "fragment": 0, "staleness": 0},
        {"worker_id": "b", "round": 0, "fragment": 0, "staleness": 0},
    ]
    c.submit("c", 0, grad(0.1))  # a new window, for c alone
    assert c.version == 1
    clock.advance(5.01)
    assert c.evict_stale() == []  # the eviction ticker also closes a window past its deadline
    assert c.version == 2


def test_the_grace_window_closes_early_once_every_live_worker_arrived() -> None:
    c, _ = asynchronous(grace_seconds=60)
    c.submit("a", 0, grad(0.2))
    assert c.version == 0
    c.submit("b", 0, grad(0.2))
    assert c.version == 1


def test_async_rejections_change_nothing() -> None:
    c, _ = asynchronous(grace_seconds=60)
    future = rejected(c, lambda: c.submit("a", 1, grad(0.2)), 409, "future_round")
    assert future.detail == {"current_round": 0}
    rejected(c, lambda: c.submit("a", 0, grad(0.2), fragment=1), 422, "invalid_request")
    rejected(c, lambda: c.submit("a", 0, grad(float("inf"))), 422, "non_finite")
    rejected(c, lambda: c.wait_result(0, None, 0), 422, "invalid_request")
    negative = rejected(c, lambda: c.submit("a", -7, grad(0.2)), 422, "invalid_request")
    assert negative.detail == {"field": "round", "got": -7}
    rejected(c, lambda: c.wait_result(-1, "a", 0), 422, "invalid_request")
    c.submit("a", 0, grad(0.2))
    assert c.submit("a", 0, grad(0.2))["status"] == "duplicate"  # still pending: counted once
    rejected(c, lambda: c.wait_result(1, "a", 0), 409, "future_round")


def test_a_second_arrival_while_one_is_pending_is_409() -> None:
    c, clock = asynchronous(workers=("a", "b", "c"), grace_seconds=60, heartbeat_timeout=600)
    c.submit("b", 0, grad(0.4))
    c.submit("c", 0, grad(0.6))
    clock.advance(61)
    assert c.evict_stale() == [] and c.version == 1  # the window closed at its deadline
    c.submit("a", 1, grad(0.2))  # pending in the next window
    # An arrival for version 0 (never applied for a) while that one is pending: refused.
    pending = rejected(c, lambda: c.submit("a", 0, grad(0.2)), 409, "already_pending")
    assert pending.detail == {"pending_round": 1}


def test_dylu_recommends_h_from_smoothed_speeds() -> None:
    """H_w = max(1, floor(v_w / max v * H)): speeds [1, 0.5, 0.26], H = 100 give [100, 50, 26];
    each worker's speed is the median of its last windows, so one noisy window does not swing
    it, and a heartbeat that repeats a window adds no sample."""
    c, _ = asynchronous(workers=("fast", "half", "slow"), sync_every=100, dylu=True)
    assert c.heartbeat("fast", 10, 1.0, None, 0, windows=0)["recommended_sync_every"] is None
    for window in range(1, 4):
        for worker, speed in (("fast", 1.0), ("half", 0.5), ("slow", 0.26)):
            c.heartbeat(worker, window, speed, None, 0, windows=window)
    recommended = {
        w: c.heartbeat(w, 4, 0.0, None, 0, windows=3)["recommended_sync_every"]
        for w in ("fast", "half", "slow")
    }
    assert recommended == {"fast": 100, "half": 50, "slow": 26}
    c.heartbeat("half", 5, 5.0, None, 0, windows=4)  # one window five times faster (noise)
    assert c.heartbeat("half", 5, 5.0, None, 0, windows=4)["recommended_sync_every"] == 50
    workers = {w["worker_id"]: w for w in c.status()["workers"]}
    assert workers["slow"]["recommended_sync_every"] == 26
    c.deregister("fast")  # the fastest left: the others are measured against each other
    assert c.heartbeat("half", 6, 0.5, None, 0, windows=5)["recommended_sync_every"] == 100


def test_dylu_is_off_without_the_flag() -> None:
    c, _ = asynchronous()
    c.heartbeat("a", 1, 1.0, None, 0, windows=1)
    assert c.heartbeat("b", 1, 0.1, None, 0, windows=1)["recommended_sync_every"] is None


def test_settings_of_the_async_mode_are_checked() -> None:
    with pytest.raises(ValueError, match="barrier_timeout does not apply to mode async"):
        ServerSettings(mode="async", barrier_timeout=10.0)
    with pytest.raises(ValueError, match="outer_optimizer must be nesterov"):
        ServerSettings(mode="async", outer_optimizer="sgd")
    with pytest.raises(ValueError, match="grace_seconds applies to mode async only"):
        ServerSettings(grace_seconds=1.0)
    with pytest.raises(ValueError, match="dylu applies to mode async only"):
        ServerSettings(mode="streaming", dylu=True)
    with pytest.raises(ValueError, match=r"delayed nesterov c must be"):
        ServerSettings(mode="async", dn_c=1.5)
    assert ServerSettings(mode="async").to_wire()["barrier_timeout"] is None
    assert ServerSettings().to_wire()["barrier_timeout"] == 600.0
