"""Server-dispatched data at the coordinator: leases, reported units, commits, crashes.

The coordinator is driven by method calls with a fake clock (as in test_server_coordinator), its
work pool on real SQLite: in memory for the round logic, a real state dir in tmp_path for the
durability cases, where `crash(c)` closes the store as kill -9 would leave it.

Throughout, the dataset `ds` has 100 samples in units of 10 (seed 7), so an epoch is 10 units;
unit ids are handed out 1, 2, 3, ... in lease order, and outer SGD with lr 1 makes the new weight
the old one minus the mean pseudo-gradient (10 with -2 and -8 gives 15).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crashes import killed

from diloco.algorithm.permutation import Permutation
from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import TensorSpec, decode_tensors

W_SPEC = [TensorSpec("w", (), torch.float32, "trainable")]
SETTINGS = ServerSettings(outer_optimizer="sgd", outer_lr=1.0, heartbeat_timeout=30.0)
LENGTH, UNIT, SEED = 100, 10, 7


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def grad(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(value, dtype=torch.float32)}


def make(workers: tuple[str, ...] = ("a", "b")) -> tuple[Coordinator, FakeClock]:
    """An in-memory coordinator at w = 10 with `workers` registered and dataset `ds` known."""
    clock = FakeClock()
    c = Coordinator(SETTINGS, grad(10.0), clock=clock)
    for worker_id in workers:
        c.register(worker_id, W_SPEC, protocol_version=1)
    c.register_dataset(workers[0], "ds", LENGTH, SEED, UNIT)
    return c, clock


def ids(answer: dict) -> list[int]:
    return [unit["unit_id"] for unit in answer["units"]]


def lease(c: Coordinator, worker_id: str, count: int, **options: Any) -> list[int]:
    answer = c.lease_units(worker_id, "ds", count, **options)
    assert answer["status"] == "leased", answer
    return ids(answer)


def done(c: Coordinator) -> list[tuple[int, int, str]]:
    """(unit_id, round, worker) of every completed unit."""
    return [(u["unit_id"], u["round"], u["worker_id"]) for u in c.pool.completions()]


def progress(c: Coordinator) -> tuple[int, int, int]:
    """(completed, leased, free) of epoch 0 of `ds`."""
    (epoch,) = [p for p in c.pool.progress("ds") if p["epoch"] == 0]
    return epoch["completed"], epoch["leased"], epoch["free"]


def state_of(c: Coordinator) -> dict[str, Any]:
    """What a refused request must leave as it was: the round, the pool, the counters."""
    current = c.round
    assert current is not None
    return {
        "round": c.round_number,
        "submitted": dict(current.submitted),
        "units": {w: list(u) for w, u in current.units.items()},
        "running": None if current.running is None else current.running.count,
        "members": set(current.members),
        "tokens": current.tokens,
        "masters": {n: t.clone() for n, t in (c.masters or {}).items()},
        "bytes_in": c.traffic.bytes_in,
        "contributed": {w.worker_id: w.rounds_contributed for w in c.membership.workers.values()},
        "progress": c.pool.progress(),
        "units_table": c.pool.conn.execute("SELECT * FROM wu_units ORDER BY unit_id").fetchall(),
        "datasets": c.pool.datasets(),
        "rounds": c.journal.state.committed_rounds(),
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in a:
        if key == "masters":
            assert a[key].keys() == b[key].keys()
            assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
        else:
            assert a[key] == b[key], (key, a[key], b[key])


def rejected(c: Coordinator, call: Callable[[], object], status: int, kind: str) -> Rejection:
    """Run `call`, expect Rejection(status, kind) and no change of state; return it."""
    before = state_of(c)
    with pytest.raises(Rejection) as caught:
        call()
    assert (caught.value.status, caught.value.kind) == (status, kind), caught.value.to_body()
    same_state(before, state_of(c))
    return caught.value


def w_of(c: Coordinator) -> float:
    return decode_tensors(c.weights().body)["w"].item()


# ----------------------------------------------------------------------- reported units


def test_reported_units_complete_when_the_round_commits_not_before() -> None:
    c, _ = make()
    shape = c.pool.dataset("ds")
    assert shape == {
        "dataset_id": "ds",
        "length": 100,
        "unit_size": 10,
        "shuffle_seed": 7,
        "units_per_epoch": 10,
        "epoch": 0,
    }
    a_lease = c.lease_units("a", "ds", 2)
    assert a_lease["status"] == "leased" and a_lease["epoch"] == 0
    assert [(u["unit_id"], u["epoch"], u["index"]) for u in a_lease["units"]] == [
        (1, 0, 0),
        (2, 0, 1),
    ]
    order = Permutation(LENGTH, SEED, 0)
    assert a_lease["units"][0]["indices"] == [order(p) for p in range(0, 10)]
    assert a_lease["units"][1]["indices"] == [order(p) for p in range(10, 20)]
    assert lease(c, "b", 1) == [3]
    assert progress(c) == (0, 3, 7)

    answer = c.submit("a", 0, grad(-2.0), units=[2, 1])
    assert answer == {
        "status": "accepted",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["b"],
    }
    # Folded, but the round has not committed: the units are still only leased.
    assert c.round is not None and c.round.units == {"a": [1, 2]}
    assert done(c) == [] and progress(c) == (0, 3, 7)
    assert [c.pool.unit(u)["state"] for u in (1, 2, 3)] == ["leased"] * 3
    assert c.journal.state.committed_rounds() == []

    c.submit("b", 0, grad(-8.0), units=[3])
    assert c.round_number == 1 and w_of(c) == 15.0
    assert done(c) == [(1, 0, "a"), (2, 0, "a"), (3, 0, "b")]
    assert progress(c) == (3, 0, 7)
    assert c.status()["datasets"] == c.data_progress() == c.pool.progress()
    assert c.last_commit is not None and c.last_commit.units == [1, 2, 3]
    (row,) = c.journal.state.committed_rounds()
    assert (row["round"], row["contributors"], row["units"]) == (0, ["a", "b"], [1, 2, 3])

    # A retry of the committed submission is answered "duplicate" (the round used it) and
    # counts nothing twice.
    again = c.submit("a", 0, grad(-2.0), units=[1, 2])
    assert again["status"] == "duplicate"
    assert done(c) == [(1, 0, "a"), (2, 0, "a"), (3, 0, "b")]

    # A round without units commits and completes nothing.
    c.submit("a", 1, grad(-2.0))
    c.submit("b", 1, grad(-8.0))
    assert c.round_number == 2 and w_of(c) == 20.0
    assert [r["units"] for r in c.journal.state.committed_rounds()] == [[1, 2, 3], []]
    assert progress(c) == (3, 0, 7)


def test_units_the_worker_does_not_hold_refuse_the_submission_before_it_is_folded() -> None:
    c, _ = make()
    assert lease(c, "a", 1) == [1]
    assert lease(c, "b", 1) == [2]

    refused = rejected(
        c, lambda: c.submit("b", 0, grad(-8.0), units=[2, 1]), 422, "unit_not_leased"
    )
    assert refused.detail == {"unit_id": 1, "worker_id": "b", "holder": "a", "state": "leased"}
    assert "work unit 1" in refused.error and "'a'" in refused.error
    assert c.round is not None and c.round.submitted == {} and c.round.running is None
    assert c.round.units == {} and c.round.waiting_for() == ["a", "b"]

    unknown = rejected(c, lambda: c.submit("b", 0, grad(-8.0), units=[99]), 422, "unknown_unit")
    assert unknown.detail == {"unit_id": 99}
    invalid = rejected(c, lambda: c.submit("b", 0, grad(-8.0), units=[0]), 422, "invalid_request")
    assert invalid.detail["field"] == "unit_ids"
    # Bad tensors with good units: refused as well, and the units are not recorded.
    rejected(
        c, lambda: c.submit("b", 0, {"v": torch.tensor(1.0)}, units=[2]), 422, "unknown_tensor"
    )

    # The same worker then submits what it holds: accepted, and round 0 commits with it.
    assert c.submit("b", 0, grad(-8.0), units=[2])["status"] == "accepted"
    assert c.round.units == {"b": [2]}
    c.submit("a", 0, grad(-2.0), units=[1])
    assert c.round_number == 1 and w_of(c) == 15.0
    assert done(c) == [(1, 0, "a"), (2, 0, "b")]

    # A unit completed by another worker is not this worker's to report either.
    refused = rejected(c, lambda: c.submit("b", 1, grad(-8.0), units=[1]), 422, "unit_not_leased")
    assert refused.detail == {"unit_id": 1, "worker_id": "b", "holder": "a", "state": "completed"}


@pytest.mark.parametrize("how", ["evicted", "deregistered"])
def test_a_departing_worker_returns_unfinished_leases_but_its_reported_units_complete(
    how: str,
) -> None:
    c, clock = make()
    assert lease(c, "a", 3) == [1, 2, 3]
    assert lease(c, "b", 1) == [4]
    c.submit("a", 0, grad(-2.0), units=[1, 2])  # unit 3 is still being trained
    assert progress(c) == (0, 4, 6)

    if how == "evicted":
        clock.advance(31)
        c.heartbeat("b", 1, 1.0, None, 0)
        assert c.evict_stale() == ["a"]
    else:
        c.deregister("a")
    assert not c.membership.is_live("a")
    assert c.round_number == 0 and c.round is not None and c.round.waiting_for() == ["b"]
    # 3 went back to the pool; 1 and 2 stay with the open round that trained them.
    assert [c.pool.unit(u)["state"] for u in (1, 2, 3)] == ["leased", "leased", "free"]
    assert progress(c) == (0, 3, 7)
    (event,) = c.journal.state.audit_log(how)
    assert (event["worker_id"], event["round"], event["detail"]) == ("a", 0, {"released": 1})

    # A released unit is leased again before any new one.
    assert lease(c, "b", 2) == [3, 5]
    assert [(u["unit_id"], u["index"]) for u in c.pool.leases_of("b")] == [(3, 2), (4, 3), (5, 4)]
    c.submit("b", 0, grad(-8.0), units=[3, 4])
    assert c.round_number == 1 and w_of(c) == 15.0  # a's contribution stayed in the round
    assert done(c) == [(1, 0, "a"), (2, 0, "a"), (3, 0, "b"), (4, 0, "b")]
    assert c.journal.state.committed_rounds()[0]["units"] == [1, 2, 3, 4]
    assert progress(c) == (4, 1, 5)


def test_a_worker_evicted_before_submitting_loses_its_leases_to_others() -> None:
    c, clock = make()
    assert lease(c, "a", 2) == [1, 2]
    clock.advance(31)
    c.heartbeat("b", 1, 1.0, None, 0)
    assert c.evict_stale() == ["a"]
    assert progress(c) == (0, 0, 10)
    assert lease(c, "b", 1) == [1]

    # a comes back under its id and reports what it trained before the eviction: refused,
    # naming the unit and its new holder; without the lost units the submission is accepted.
    c.register("a", W_SPEC, protocol_version=1)
    assert c.round is not None and c.round.members == {"a", "b"}
    refused = rejected(c, lambda: c.submit("a", 0, grad(-2.0), units=[1]), 422, "unit_not_leased")
    assert refused.detail["holder"] == "b"
    refused = rejected(c, lambda: c.submit("a", 0, grad(-2.0), units=[2]), 422, "unit_not_leased")
    assert refused.detail == {"unit_id": 2, "worker_id": "a", "holder": None, "state": "free"}
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0), units=[1])
    assert done(c) == [(1, 0, "b")] and progress(c) == (1, 0, 9)


# ----------------------------------------------------------------------- leases and datasets


def test_the_same_lease_key_gets_the_same_units_a_new_key_new_ones() -> None:
    c, _ = make()
    first = c.lease_units("a", "ds", 2, lease_key="key-0001")
    again = c.lease_units("a", "ds", 2, lease_key="key-0001")
    assert again == first and ids(first) == [1, 2]
    assert progress(c) == (0, 2, 8)
    assert lease(c, "a", 2, lease_key="key-0002") == [3, 4]
    assert lease(c, "b", 2, lease_key="key-0001") == [5, 6]  # keys belong to one worker
    assert ids(c.lease_units("b", "ds", 2, lease_key="key-0001")) == [5, 6]
    assert progress(c) == (0, 6, 4)
    assert [u["unit_id"] for u in c.pool.leases_of("a")] == [1, 2, 3, 4]

    c.register_dataset("a", "other", 10, 0, 5)
    refused = rejected(
        c, lambda: c.lease_units("a", "other", 1, lease_key="key-0001"), 422, "invalid_request"
    )
    assert refused.detail["field"] == "lease_key"


def test_registration_is_idempotent_and_a_conflict_names_the_field() -> None:
    c, _ = make()
    assert c.register_dataset("b", "ds", LENGTH, SEED, UNIT) == c.pool.dataset("ds")
    assert len(c.journal.state.audit_log("dataset_registered")) == 1
    (event,) = c.journal.state.audit_log("dataset_registered")
    assert event["worker_id"] == "a"
    assert event["detail"] == {"dataset_id": "ds", "length": 100, "unit_size": 10}

    for field, shape, stored, got in [
        ("length", (101, SEED, UNIT), 100, 101),
        ("shuffle_seed", (LENGTH, 8, UNIT), 7, 8),
        ("unit_size", (LENGTH, SEED, 20), 10, 20),
    ]:
        refused = rejected(
            c, lambda shape=shape: c.register_dataset("b", "ds", *shape), 409, "dataset_conflict"
        )
        assert refused.detail == {
            "dataset_id": "ds",
            "field": field,
            "expected": stored,
            "got": got,
        }
        assert f"{field}={stored}" in refused.error

    for args, field in [
        (("bad id!", 10, 0, 5), "dataset_id"),
        (("x", 0, 0, 5), "length"),
        (("x", 10, -1, 5), "shuffle_seed"),
        (("x", 10, 0, 0), "unit_size"),
    ]:
        refused = rejected(
            c, lambda args=args: c.register_dataset("a", *args), 422, "invalid_request"
        )
        assert refused.detail["field"] == field
    assert c.pool.datasets() == ["ds"]


def test_unknown_datasets_and_workers_are_404() -> None:
    c, clock = make()
    refused = rejected(c, lambda: c.lease_units("a", "nope", 1), 404, "unknown_dataset")
    assert refused.detail == {"dataset_id": "nope"}
    refused = rejected(c, lambda: c.lease_units("ghost", "ds", 1), 404, "unknown_worker")
    assert refused.detail == {"worker_id": "ghost"}
    rejected(c, lambda: c.lease_units("ghost", "nope", 1), 404, "unknown_worker")  # worker first
    rejected(c, lambda: c.register_dataset("ghost", "new", 10, 0, 5), 404, "unknown_worker")
    rejected(c, lambda: c.lease_units("a", "ds", 0), 422, "invalid_request")
    rejected(c, lambda: c.lease_units("a", "ds", 1025), 422, "invalid_request")
    rejected(c, lambda: c.submit("ghost", 0, grad(1.0), units=[1]), 404, "unknown_worker")

    clock.advance(31)
    c.heartbeat("b", 1, 1.0, None, 0)
    assert c.evict_stale() == ["a"]
    rejected(c, lambda: c.lease_units("a", "ds", 1), 404, "unknown_worker")
    rejected(c, lambda: c.register_dataset("a", "ds", LENGTH, SEED, UNIT), 404, "unknown_worker")


def test_a_lease_counts_as_a_sign_of_life() -> None:
    c, clock = make()
    clock.advance(20)
    c.lease_units("a", "ds", 1)
    c.heartbeat("b", 1, 1.0, None, 0)
    clock.advance(20)  # a leased 20 s ago: not stale
    c.heartbeat("b", 1, 1.0, None, 0)
    assert c.evict_stale() == []


# ----------------------------------------------------------------------- durability


def coordinator(state: Path, initial: dict | None = None, **journal: Any) -> Coordinator:
    store = RoundJournal(StateStore(state), SETTINGS, **journal)
    try:
        return Coordinator(SETTINGS, initial, clock=FakeClock(), journal=store)
    except BaseException:
        store.state.close()
        raise


def crash(c: Coordinator) -> None:
    """What kill -9 leaves: the files as they are, and the state dir's lock released."""
    killed(c)


def started(state: Path, **journal: Any) -> Coordinator:
    c = coordinator(state, grad(10.0), **journal)
    for worker_id in ("a", "b"):
        c.register(worker_id, W_SPEC, protocol_version=1)
    c.register_dataset("a", "ds", LENGTH, SEED, UNIT)
    return c


def test_units_leases_and_datasets_survive_a_crash(tmp_path: Path) -> None:
    c = started(tmp_path)
    c.register("gone", W_SPEC, protocol_version=1)
    assert lease(c, "a", 2) == [1, 2]
    assert lease(c, "b", 2) == [3, 4]
    assert lease(c, "gone", 1) == [5]
    c.submit("a", 0, grad(-2.0), units=[1])
    c.submit("b", 0, grad(-8.0), units=[3])
    c.submit("gone", 0, grad(-5.0))
    assert c.round_number == 1 and w_of(c) == 15.0
    c.deregister("gone")  # unit 5 goes back to the pool
    assert lease(c, "a", 1) == [5]
    crash(c)

    c = coordinator(tmp_path)
    assert c.round_number == 1 and w_of(c) == 15.0
    assert c.membership.live_ids() == {"a", "b"}
    assert c.round is not None and c.round.members == {"a", "b"}
    assert c.round.waiting_for() == ["a", "b"]
    assert c.pool.datasets() == ["ds"]
    assert c.pool.dataset("ds")["units_per_epoch"] == 10
    assert done(c) == [(1, 0, "a"), (3, 0, "b")]
    assert [u["unit_id"] for u in c.pool.leases_of("a")] == [2, 5]
    assert [u["unit_id"] for u in c.pool.leases_of("b")] == [4]
    assert [u["unit_id"] for u in c.pool.leases_of("gone")] == []
    assert progress(c) == (2, 3, 5)
    assert len(c.journal.state.audit_log("dataset_registered")) == 1
    # The same shape registers again without conflict; another is still a conflict.
    c.register_dataset("a", "ds", LENGTH, SEED, UNIT)
    rejected(c, lambda: c.register_dataset("a", "ds", 50, SEED, UNIT), 409, "dataset_conflict")

    # The lease cursor survived: the next new unit is index 5.
    c.register("c", W_SPEC, protocol_version=1)
    assert [(u["unit_id"], u["index"]) for u in c.lease_units("c", "ds", 1)["units"]] == [(6, 5)]
    c.submit("a", 1, grad(-2.0), units=[2, 5])
    c.submit("b", 1, grad(-8.0), units=[4])
    c.submit("c", 1, grad(-5.0), units=[6])
    assert c.round_number == 2 and w_of(c) == 20.0
    assert done(c) == [(1, 0, "a"), (2, 1, "a"), (3, 0, "b"), (4, 1, "b"), (5, 1, "a"), (6, 1, "c")]
    assert [r["units"] for r in c.journal.state.committed_rounds()] == [[1, 3], [2, 4, 5, 6]]
    crash(c)


def test_units_kept_for_an_open_round_the_crash_lost_are_leased_again(tmp_path: Path) -> None:
    c = started(tmp_path)
    assert lease(c, "a", 2) == [1, 2]
    c.submit("a", 0, grad(-2.0), units=[1, 2])
    c.deregister("a")  # 1 and 2 stay with the open round...
    assert [c.pool.unit(u)["state"] for u in (1, 2)] == ["leased", "leased"]
    crash(c)  # ...which the crash loses before it commits

    c = coordinator(tmp_path)
    assert c.round_number == 0 and c.membership.live_ids() == {"b"}
    assert progress(c) == (0, 0, 10)
    assert lease(c, "b", 2) == [1, 2]
    crash(c)


def test_a_commit_missing_from_sqlite_is_replayed_from_the_checkpoint(tmp_path: Path) -> None:
    c = started(tmp_path)
    assert lease(c, "a", 2) == [1, 2]
    assert lease(c, "b", 1) == [3]
    c.submit("a", 0, grad(-2.0), units=[1, 2])
    c.submit("b", 0, grad(-8.0), units=[3])
    assert c.round_number == 1
    crash(c)

    # As if the process died between the checkpoint and the SQLite transaction of round 0.
    with sqlite3.connect(tmp_path / "state.sqlite") as db:
        db.execute("DELETE FROM rounds WHERE round = 0")
        db.execute("DELETE FROM submissions WHERE version = 0")
        db.execute("DELETE FROM metrics WHERE round = 0")
        db.execute("DELETE FROM audit WHERE event = 'outer_step' AND round = 0")
        db.execute(
            "UPDATE workers SET rounds_contributed = rounds_contributed - 1"
            " WHERE worker_id IN ('a', 'b')"
        )
        changed = db.execute(
            "UPDATE wu_units SET state = 'leased', completed_round = NULL WHERE completed_round = 0"
        ).rowcount
        assert changed == 3
    db.close()

    for _ in range(2):  # the replay happens once, a second restart finds it done
        c = coordinator(tmp_path)
        assert c.round_number == 1 and w_of(c) == 15.0
        (row,) = c.journal.state.committed_rounds()
        assert (row["round"], row["contributors"], row["units"]) == (0, ["a", "b"], [1, 2, 3])
        assert done(c) == [(1, 0, "a"), (2, 0, "a"), (3, 0, "b")]
        assert progress(c) == (3, 0, 7)
        assert len(c.journal.state.audit_log("outer_step")) == 1
        assert [w["rounds_contributed"] for w in c.journal.state.workers()] == [1, 1]
        crash(c)


def five_rounds(c: Coordinator) -> dict[int, list[int]]:
    """Rounds 0..4, each a and b with one new unit; w goes 10, 15, ..., 35."""
    units = {}
    for number in range(5):
        mine, theirs = lease(c, "a", 1), lease(c, "b", 1)
        c.submit("a", number, grad(-2.0), units=mine)
        c.submit("b", number, grad(-8.0), units=theirs)
        units[number] = mine + theirs
    assert c.round_number == 5 and w_of(c) == 35.0
    assert units == {r: [2 * r + 1, 2 * r + 2] for r in range(5)}
    return units


def test_interval_durability_rolls_back_lost_rounds_and_frees_their_units(tmp_path: Path) -> None:
    interval = {"durability": "interval", "checkpoint_every": 3}
    c = started(tmp_path, **interval)
    five_rounds(c)
    assert c.journal.saved_round == 3
    assert c.journal.state.checkpoints is not None
    assert c.journal.state.checkpoints.generations() == [0, 1]  # round 0 and round 3
    assert [r["round"] for r in c.journal.state.committed_rounds()] == [0, 1, 2, 3, 4]
    crash(c)

    c = coordinator(tmp_path, **interval)
    assert c.round_number == 3 and w_of(c) == 25.0
    assert c.round is not None and c.round.members == {"a", "b"}
    assert [r["round"] for r in c.journal.state.committed_rounds()] == [0, 1, 2]
    assert done(c) == [(u, (u - 1) // 2, "ab"[(u - 1) % 2]) for u in range(1, 7)]
    assert [c.pool.unit(u)["state"] for u in range(7, 11)] == ["free"] * 4
    assert all(c.pool.unit(u)["round"] is None for u in range(7, 11))
    assert progress(c) == (6, 0, 4)
    (event,) = c.journal.state.audit_log("rolled_back")
    assert event["round"] == 3 and event["detail"] == {"rounds": [3, 4]}
    # the rounds each worker contributed are the 3 that remain, in the store and the status
    assert [w["rounds_contributed"] for w in c.journal.state.workers()] == [3, 3]
    assert [w["rounds_contributed"] for w in c.status()["workers"]] == [3, 3]

    # The freed units are leased again, lowest index first, before the never-leased ones.
    answer = c.lease_units("a", "ds", 5)
    assert [(u["unit_id"], u["index"]) for u in answer["units"]] == [
        (7, 6),
        (8, 7),
        (9, 8),
        (10, 9),
    ]
    assert c.lease_units("b", "ds", 1)["status"] == "exhausted"  # epoch 0 has no unit left
    c.submit("a", 3, grad(-2.0), units=[7, 8, 9, 10])
    c.submit("b", 3, grad(-8.0))
    assert c.round_number == 4 and w_of(c) == 30.0
    assert done(c)[6:] == [(u, 3, "a") for u in (7, 8, 9, 10)]
    assert progress(c) == (10, 0, 0)
    crash(c)


def test_a_graceful_shutdown_in_interval_mode_loses_no_round(tmp_path: Path) -> None:
    interval = {"durability": "interval", "checkpoint_every": 3}
    c = started(tmp_path, **interval)
    units = five_rounds(c)
    c.shutdown()

    c = coordinator(tmp_path, **interval)
    assert c.round_number == 5 and w_of(c) == 35.0
    assert [r["round"] for r in c.journal.state.committed_rounds()] == [0, 1, 2, 3, 4]
    assert [r["units"] for r in c.journal.state.committed_rounds()] == list(units.values())
    assert done(c) == [(u, (u - 1) // 2, "ab"[(u - 1) % 2]) for u in range(1, 11)]
    assert progress(c) == (10, 0, 0)
    assert c.journal.state.audit_log("rolled_back") == []
    assert [w["rounds_contributed"] for w in c.status()["workers"]] == [5, 5]
    crash(c)
