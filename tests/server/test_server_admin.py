"""An operator's actions on the coordinator (no HTTP): pause and resume, the outer lr,
evictions and bans, each durable across a restart and audited.

Expected weights are the DiLoCo reference vectors worked by hand (DESIGN.md): base 10, two
workers whose updates L - G are +2 and +8 (pseudo-gradients -2 and -8), outer SGD without
momentum: lr 1 gives 15, lr 0.5 gives 12.5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crashes import killed

from diloco.server.coordinator import Coordinator, RoundResult, Waiting
from diloco.server.errors import Rejection
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import TensorSpec, decode_tensors

SPECS = [TensorSpec("w", (), torch.float32, "trainable")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(state: Path | None = None, **settings) -> tuple[Coordinator, Clock]:
    """A coordinator at w = 10 with workers a and b (outer SGD, lr 1 unless given)."""
    settings = {"outer_optimizer": "sgd", "outer_lr": 1.0, **settings}
    if settings.get("mode") == "async":
        settings.update(outer_optimizer="nesterov", outer_momentum=0.0)
    clock = Clock()
    journal = RoundJournal(StateStore(state), ServerSettings(**settings))
    restored = state is not None and any((state / "checkpoints").glob("gen-*"))
    c = Coordinator(
        journal.settings,
        None if restored else {"w": torch.tensor(10.0)},
        clock=clock,
        journal=journal,
    )
    for worker in ("a", "b"):
        if not c.membership.is_live(worker):
            c.register(worker, SPECS, 1)
    return c, clock


def w(c: Coordinator) -> float:
    return float(c.masters["w"])


def result_w(answer: RoundResult | Waiting) -> float:
    assert isinstance(answer, RoundResult), answer
    return float(decode_tensors(answer.body)["w"])


def submit(c: Coordinator, worker: str, round_number: int, update: float) -> dict:
    """`update` is L - G; the pseudo-gradient sent is its negative."""
    return c.submit(worker, round_number, {"w": torch.tensor(-update)})


def test_a_paused_round_folds_submissions_but_commits_only_at_resume() -> None:
    c, _ = make()
    assert c.admin.pause("admin") == {"paused": True, "changed": True, "round": 0}
    assert c.admin.pause("admin")["changed"] is False  # already paused: nothing written twice
    submit(c, "a", 0, 2.0)
    submit(c, "b", 0, 8.0)
    assert (c.round_number, w(c)) == (0, 10.0)  # both in, nothing applied
    assert isinstance(c.wait_result(0, "a", wait=0), Waiting)
    assert c.status()["paused"] is True
    answer = c.admin.resume("admin")
    assert answer["changed"] is True and answer["round"] == 1
    assert w(c) == 15.0  # mean update +5, lr 1
    assert result_w(c.wait_result(0, "a", wait=0)) == 15.0
    assert c.admin.resume("admin")["changed"] is False
    log = c.journal.state.audit_log()
    events = [e["event"] for e in log if e["event"] in ("paused", "resumed")]
    assert events == ["paused", "resumed"]


def test_the_barrier_timeout_does_not_run_while_paused() -> None:
    c, clock = make(barrier_timeout=60.0)
    c.admin.pause("admin")
    submit(c, "a", 0, 2.0)
    for _ in range(10):  # 500 s paused, heartbeats going on: b is not blamed for the pause
        clock.now += 50
        c.heartbeat("a", step=1, steps_per_second=1.0, loss=None, tokens=0)
        c.heartbeat("b", step=1, steps_per_second=1.0, loss=None, tokens=0)
        assert c.evict_stale() == []
    c.admin.resume("admin")
    clock.now += 50  # 50 s of unpaused waiting since a's submission: within the timeout
    c.heartbeat("a", step=1, steps_per_second=1.0, loss=None, tokens=0)
    c.heartbeat("b", step=1, steps_per_second=1.0, loss=None, tokens=0)
    assert c.evict_stale() == []
    clock.now += 20  # 70 s unpaused: b is overdue now
    c.heartbeat("a", step=1, steps_per_second=1.0, loss=None, tokens=0)
    c.heartbeat("b", step=1, steps_per_second=1.0, loss=None, tokens=0)
    assert c.evict_stale() == ["b"]
    assert w(c) == 12.0  # the round went on with a alone: +2


def test_a_first_submission_made_during_a_pause_gets_the_whole_timeout_after_it() -> None:
    c, clock = make(barrier_timeout=60.0)
    c.admin.pause("admin")
    clock.now += 3000
    submit(c, "a", 0, 2.0)  # 10 s before the resume
    clock.now += 10
    c.admin.resume("admin")
    for _ in range(2):  # 59 s after the resume: b is not late yet
        clock.now += 29.5
        c.heartbeat("a", step=1, steps_per_second=1.0, loss=None, tokens=0)
        c.heartbeat("b", step=1, steps_per_second=1.0, loss=None, tokens=0)
        assert c.evict_stale() == []
    clock.now += 2  # 61 s: late, whatever the pause lasted
    c.heartbeat("a", step=1, steps_per_second=1.0, loss=None, tokens=0)
    c.heartbeat("b", step=1, steps_per_second=1.0, loss=None, tokens=0)
    assert c.evict_stale() == ["b"]


def test_async_arrivals_held_while_paused_are_applied_as_one_step_at_resume() -> None:
    c, _ = make(mode="async")
    c.admin.pause("admin")
    submit(c, "a", 0, 2.0)
    submit(c, "b", 0, 8.0)
    assert (c.version, w(c)) == (0, 10.0)
    assert isinstance(c.wait_result(0, "a", wait=0), Waiting)
    c.admin.resume("admin")
    # One step of the two held arrivals: SGD (Nesterov with momentum 0), lr 1: 10 + 5.
    assert (c.version, w(c)) == (1, 15.0)
    assert result_w(c.wait_result(0, "b", wait=0)) == 15.0


def test_a_new_outer_lr_applies_from_the_next_step_and_survives_a_restart(tmp_path: Path) -> None:
    c, _ = make(tmp_path)
    submit(c, "a", 0, 2.0)
    submit(c, "b", 0, 8.0)
    assert w(c) == 15.0  # lr 1
    answer = c.admin.set_outer_lr(0.5, "admin")
    assert answer == {"outer_lr": 0.5, "previous": 1.0, "from_round": 1}
    assert c.info()["settings"]["outer_optimizer"]["lr"] == 0.5
    assert c.status()["outer_lr"] == 0.5
    killed(c)  # as kill -9 leaves it: no checkpoint since the change

    again, _ = make(tmp_path)  # the same command line, lr 1
    assert again.settings.outer_lr == 0.5
    assert again.model.optimizer.lr == 0.5
    submit(again, "a", 1, 2.0)
    submit(again, "b", 1, 8.0)
    assert w(again) == 17.5  # 15 + 0.5 x 5
    (event,) = again.journal.state.audit_log("outer_lr_changed")
    assert event["detail"] == {"by": "admin", "previous": 1.0, "lr": 0.5}
    killed(again)

    # --override-settings: the command line's lr wins, and the admin's is forgotten.
    settings = ServerSettings(outer_optimizer="sgd", outer_lr=1.0)
    journal = RoundJournal(StateStore(tmp_path), settings, override_settings=True)
    third = Coordinator(settings, journal=journal)
    assert third.model.optimizer.lr == 1.0
    assert third.journal.state.audit_log("outer_lr_overridden")
    killed(third)


@pytest.mark.parametrize("lr", [0.0, -1.0, float("nan"), float("inf"), True, "0.5"])
def test_a_bad_outer_lr_is_refused_and_changes_nothing(lr) -> None:
    c, _ = make()
    with pytest.raises(Rejection) as caught:
        c.admin.set_outer_lr(lr, "admin")
    assert (caught.value.status, caught.value.kind) == (422, "invalid_request")
    assert "outer_lr must be > 0" in caught.value.error
    assert c.settings.outer_lr == 1.0 and c.model.optimizer.lr == 1.0
    assert c.journal.state.audit_log("outer_lr_changed") == []


def test_evicting_a_member_lets_its_round_commit_and_a_ban_keeps_it_out(tmp_path: Path) -> None:
    c, _ = make(tmp_path)
    submit(c, "a", 0, 2.0)
    answer = c.admin.evict("b", "admin", ban=True, reason="sends noise")
    assert answer == {"worker_id": "b", "evicted": True, "banned": True, "pending_dropped": False}
    assert (c.round_number, w(c)) == (1, 12.0)  # the round went on with a alone
    with pytest.raises(Rejection) as caught:
        c.register("b", SPECS, 1)
    assert (caught.value.status, caught.value.kind) == (403, "worker_banned")
    assert c.status()["banned"] == ["b"]
    (event,) = c.journal.state.audit_log("admin_evicted")
    expected = {"by": "admin", "reason": "sends noise", "released": 0}
    assert (event["worker_id"], event["detail"]) == ("b", expected)
    killed(c)

    # A restart keeps the ban.
    settings = ServerSettings(outer_optimizer="sgd", outer_lr=1.0)
    journal = RoundJournal(StateStore(tmp_path), settings)
    again = Coordinator(journal.settings, journal=journal)
    with pytest.raises(Rejection):
        again.register("b", SPECS, 1)
    assert again.admin.unban("b", "admin") == {"worker_id": "b", "banned": False}
    again.register("b", SPECS, 1)
    with pytest.raises(Rejection) as caught:
        again.admin.unban("b", "admin")
    assert (caught.value.status, caught.value.kind) == (404, "not_banned")
    killed(again)


def test_a_round_an_eviction_completes_commits_after_the_eviction_is_committed(
    tmp_path: Path,
) -> None:
    """The eviction (and ban) commit in one transaction; the step of the round it completes
    commits in its own, after: inside the admin's, a failure later in it (its COMMIT on a
    full disk) rolled back the step's rows while the new weights were already served."""
    c, _ = make(tmp_path)
    submit(c, "a", 0, 2.0)
    conn = c.journal.state.conn
    seen: list[bool] = []
    commit = c.journal.commit

    def recorded(*args, **kwargs):
        seen.append(conn.in_transaction)
        return commit(*args, **kwargs)

    c.journal.commit = recorded
    c.admin.evict("b", "admin", ban=True, reason="sends noise")
    assert seen == [False] and (c.round_number, w(c)) == (1, 12.0)
    killed(c)


def test_evicting_a_worker_that_is_not_live_is_404_unless_it_is_a_ban() -> None:
    c, _ = make()
    with pytest.raises(Rejection) as caught:
        c.admin.evict("ghost", "admin")
    assert (caught.value.status, caught.value.kind) == (404, "unknown_worker")
    assert c.admin.evict("ghost", "admin", ban=True)["evicted"] is False
    with pytest.raises(Rejection) as caught:
        c.register("ghost", SPECS, 1)
    assert caught.value.kind == "worker_banned"
    with pytest.raises(Rejection) as caught:
        c.admin.evict("../a", "admin")
    assert (caught.value.status, caught.value.detail["field"]) == (422, "worker_id")
    assert c.membership.live_ids() == {"a", "b"}


def test_a_restarted_server_is_still_paused(tmp_path: Path) -> None:
    c, _ = make(tmp_path)
    c.admin.pause("admin")
    killed(c)
    again, _ = make(tmp_path)
    assert again.status()["paused"] is True
    submit(again, "a", 0, 2.0)
    submit(again, "b", 0, 8.0)
    assert w(again) == 10.0
    again.admin.resume("admin")
    assert w(again) == 15.0
    killed(again)


@pytest.mark.parametrize("download", ["fp32", "bf16"])
def test_the_masters_download_is_fp32_whatever_workers_download(download: str) -> None:
    dtype = torch.float32 if download == "fp32" else torch.bfloat16
    c, _ = make(download_dtype=dtype)
    submit(c, "a", 0, 2.0)
    submit(c, "b", 0, 8.0625)  # mean 5.03125: w = 15.03125, 9 significant bits (bf16 has 8)
    body, version = c.admin.masters_body()
    masters = decode_tensors(bytes(body))
    assert version == 1 and masters["w"].dtype == torch.float32
    assert float(masters["w"]) == 15.03125


def test_weights_before_any_exist_and_a_stop_nobody_can_carry_out_are_refused() -> None:
    c = Coordinator(ServerSettings(), None)
    with pytest.raises(Rejection) as caught:
        c.admin.masters_body()
    assert (caught.value.status, caught.value.kind) == (404, "no_weights")
    with pytest.raises(Rejection) as caught:
        c.admin.stop("admin", supported=False)  # an app not started by `diloco server`
    assert (caught.value.status, caught.value.kind) == (501, "stop_unavailable")
    assert c.journal.state.audit_log("stop_requested") == []
