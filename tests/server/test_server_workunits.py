"""Work units: each sample of an epoch is trained once, through leases, crashes and retries."""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.algorithm.permutation import Permutation
from diloco.server.errors import Rejection
from diloco.server.workunits.pool import WorkPool
from diloco.server.workunits.schema import MAX_LEASE_SAMPLES, immediate


def open_pool(path: Path) -> tuple[sqlite3.Connection, WorkPool]:
    conn = sqlite3.connect(path)
    pool = WorkPool(conn)
    conn.commit()
    return conn, pool


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkPool]:
    conn, work = open_pool(tmp_path / "state.db")
    yield work
    conn.close()


def rejected(call, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as caught:
        call(*args, **kwargs)
    return caught.value


def unit_ids(answer: dict) -> list[int]:
    return [unit["unit_id"] for unit in answer["units"]]


def positions(answer: dict) -> list[tuple[int, int]]:
    return [(unit["epoch"], unit["index"]) for unit in answer["units"]]


# ---------------------------------------------------------------------- the permutation


@pytest.mark.parametrize("length", [1, 2, 3, 7, 1000, 2**16 + 3])
def test_the_permutation_is_a_bijection(length: int) -> None:
    assert sorted(Permutation(length, seed=11).indices(0, length)) == list(range(length))


def test_the_permutation_is_fixed_by_length_seed_and_epoch() -> None:
    first = Permutation(1000, seed=5, epoch=2).indices(0, 1000)
    assert Permutation(1000, seed=5, epoch=2).indices(0, 1000) == first
    assert Permutation(1000, seed=6, epoch=2).indices(0, 1000) != first
    assert Permutation(1000, seed=5, epoch=3).indices(0, 1000) != first
    assert first != list(range(1000))  # it does shuffle
    # pinned: these numbers are part of the format, a change would reshuffle every dataset
    assert Permutation(10, seed=42).indices(0, 10) == [7, 1, 5, 2, 3, 8, 9, 4, 0, 6]
    assert Permutation(10**9, seed=42, epoch=1).indices(0, 4) == [
        898654066,
        523171619,
        273814924,
        666907943,
    ]


def test_a_unit_of_a_billion_samples_is_cheap_and_inside_the_dataset() -> None:
    permutation = Permutation(10**9, seed=2**63 - 1, epoch=7)
    unit = permutation.indices(5_000_000, 5_000_256)
    assert len(set(unit)) == 256
    assert all(0 <= index < 10**9 for index in unit)


def test_the_permutation_refuses_positions_outside_the_dataset() -> None:
    with pytest.raises(IndexError):
        Permutation(5, seed=0)(5)
    with pytest.raises(ValueError):
        Permutation(0, seed=0)


# ---------------------------------------------------------------------- registration


def test_registration_is_lazy_and_idempotent(pool: WorkPool) -> None:
    state = pool.register("web:big", length=10**9, shuffle_seed=3, unit_size=256)
    assert state == {
        "dataset_id": "web:big",
        "length": 10**9,
        "unit_size": 256,
        "shuffle_seed": 3,
        "units_per_epoch": 3_906_250,
        "epoch": 0,
    }
    assert pool.register("web:big", length=10**9, shuffle_seed=3, unit_size=256) == state
    (rows,) = pool.conn.execute("SELECT COUNT(*) FROM wu_units").fetchone()
    assert rows == 0  # no row per unit until a unit is leased
    pool.lease("w1", "web:big", count=2, now=1.0)
    (rows,) = pool.conn.execute("SELECT COUNT(*) FROM wu_units").fetchone()
    assert rows == 2


@pytest.mark.parametrize(
    ("field", "changed", "stored", "given"),
    [
        ("length", {"length": 101}, 100, 101),
        ("unit_size", {"unit_size": 20}, 10, 20),
        ("shuffle_seed", {"shuffle_seed": 8}, 7, 8),
    ],
)
def test_another_shape_under_the_same_id_is_a_conflict(
    pool: WorkPool, field: str, changed: dict, stored: int, given: int
) -> None:
    shape = {"length": 100, "unit_size": 10, "shuffle_seed": 7}
    pool.register("books", **shape)
    error = rejected(pool.register, "books", **{**shape, **changed})
    assert (error.status, error.kind) == (409, "dataset_conflict")
    assert error.detail == {"dataset_id": "books", "field": field, "expected": stored, "got": given}
    assert field in error.error and str(stored) in error.error and str(given) in error.error


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("dataset_id", {"dataset_id": ""}),
        ("dataset_id", {"dataset_id": "-starts-with-dash"}),
        ("dataset_id", {"dataset_id": "has space"}),
        ("dataset_id", {"dataset_id": "x" * 129}),
        ("length", {"length": 0}),
        ("length", {"length": 2**53 + 1}),
        ("length", {"length": 10.0}),
        ("length", {"length": True}),
        ("unit_size", {"unit_size": 0}),
        ("shuffle_seed", {"shuffle_seed": -1}),
        ("shuffle_seed", {"shuffle_seed": 2**63}),
        ("shuffle_seed", {"shuffle_seed": "7"}),
    ],
)
def test_bad_registrations_are_refused_naming_the_field(
    pool: WorkPool, field: str, bad: dict
) -> None:
    request = {"dataset_id": "ok", "length": 10, "shuffle_seed": 1, "unit_size": 2, **bad}
    error = rejected(pool.register, **request)
    assert (error.status, error.kind, error.detail) == (422, "invalid_request", {"field": field})
    assert pool.datasets() == []


def test_the_largest_valid_values_are_accepted(pool: WorkPool) -> None:
    state = pool.register("a" * 128, length=2**53, shuffle_seed=2**63 - 1, unit_size=1)
    assert state["units_per_epoch"] == 2**53
    answer = pool.lease("w", "a" * 128, count=3, now=0.0)
    assert all(0 <= i < 2**53 for unit in answer["units"] for i in unit["indices"])


# ---------------------------------------------------------------------- leases


def test_units_cover_the_dataset_exactly_once_per_epoch(pool: WorkPool) -> None:
    pool.register("d", length=1000, shuffle_seed=9, unit_size=64)  # 16 units, the last of 40
    answer = pool.lease("w", "d", count=1024, now=0.0)
    assert answer["status"] == "leased" and answer["epoch"] == 0
    assert positions(answer) == [(0, index) for index in range(16)]
    sizes = [len(unit["indices"]) for unit in answer["units"]]
    assert sizes == [64] * 15 + [40]
    flat = [i for unit in answer["units"] for i in unit["indices"]]
    assert sorted(flat) == list(range(1000))
    assert flat == Permutation(1000, seed=9, epoch=0).indices(0, 1000)
    assert len(set(unit_ids(answer))) == 16


def test_released_units_are_leased_again_before_new_ones(pool: WorkPool) -> None:
    pool.register("d", length=100, shuffle_seed=1, unit_size=10)
    first = pool.lease("a", "d", count=3, now=1.0)
    pool.lease("b", "d", count=2, now=2.0)
    assert pool.release_worker("a") == 3
    again = pool.lease("c", "d", count=4, now=3.0)
    assert positions(again) == [(0, 0), (0, 1), (0, 2), (0, 5)]
    assert unit_ids(again)[:3] == unit_ids(first)  # a unit keeps its id across leases
    assert [unit["indices"] for unit in again["units"][:3]] == [
        unit["indices"] for unit in first["units"]
    ]
    assert [u["index"] for u in pool.leases_of("c")] == [0, 1, 2, 5]
    assert all(u["leased_at"] == 3.0 for u in pool.leases_of("c"))


def test_an_evicted_worker_returns_only_its_unfinished_units(pool: WorkPool) -> None:
    pool.register("d", length=50, shuffle_seed=1, unit_size=10)
    held = unit_ids(pool.lease("a", "d", count=3, now=0.0))
    pool.lease("b", "d", count=1, now=0.0)
    pool.check_reported("a", held[:1])
    assert pool.complete(held[:1], round_number=1, worker_id="a") == 1
    assert pool.release_worker("a") == 2
    assert pool.release_worker("a") == 0
    assert pool.leases_of("a") == []
    assert [u["unit_id"] for u in pool.leases_of("b")] == [held[-1] + 1]
    assert pool.progress("d") == [
        {"dataset_id": "d", "epoch": 0, "total": 5, "completed": 1, "leased": 1, "free": 3}
    ]


def test_an_exhausted_epoch_answers_exhausted_until_asked_to_open_the_next(
    pool: WorkPool,
) -> None:
    pool.register("d", length=30, shuffle_seed=4, unit_size=10)
    epoch0 = pool.lease("a", "d", count=5, now=0.0)
    assert len(epoch0["units"]) == 3
    nothing = pool.lease("b", "d", count=1, now=0.0)
    assert nothing == {"status": "exhausted", "dataset_id": "d", "epoch": 0, "units": []}

    epoch1 = pool.lease("b", "d", count=2, now=1.0, open_next_epoch=True)
    assert epoch1["status"] == "leased" and epoch1["epoch"] == 1
    assert positions(epoch1) == [(1, 0), (1, 1)]
    assert epoch1["units"][0]["indices"] == Permutation(30, 4, epoch=1).indices(0, 10)
    assert epoch1["units"][0]["indices"] != epoch0["units"][0]["indices"]
    assert pool.dataset("d")["epoch"] == 1

    pool.release_worker("a")  # released units of the older epoch come first
    assert positions(pool.lease("c", "d", count=5, now=2.0)) == [(0, 0), (0, 1), (0, 2), (1, 2)]
    assert pool.lease("c", "d", count=1, now=2.0)["status"] == "exhausted"
    assert [(p["epoch"], p["leased"], p["free"]) for p in pool.progress("d")] == [
        (0, 3, 0),
        (1, 3, 0),
    ]


def test_a_lease_holds_a_bounded_number_of_indices(pool: WorkPool) -> None:
    pool.register("d", length=10**6, shuffle_seed=0, unit_size=32_768)
    answer = pool.lease("w", "d", count=1024, now=0.0)
    assert len(answer["units"]) == MAX_LEASE_SAMPLES // 32_768


def test_lease_refuses_unknown_datasets_and_bad_counts(pool: WorkPool) -> None:
    error = rejected(pool.lease, "w", "nope", count=1, now=0.0)
    assert (error.status, error.kind, error.detail) == (
        404,
        "unknown_dataset",
        {"dataset_id": "nope"},
    )
    pool.register("d", length=10, shuffle_seed=0, unit_size=1)
    for count in (0, 1025, 2.0, None):
        error = rejected(pool.lease, "w", "d", count=count, now=0.0)
        assert (error.status, error.kind, error.detail) == (
            422,
            "invalid_request",
            {"field": "count"},
        )
    assert rejected(pool.progress, "nope").status == 404


# ---------------------------------------------------------------------- reports and completion


def test_check_reported_names_the_unit_and_who_holds_it(pool: WorkPool) -> None:
    pool.register("d", length=40, shuffle_seed=0, unit_size=10)
    a_units = unit_ids(pool.lease("a", "d", count=2, now=0.0))
    b_units = unit_ids(pool.lease("b", "d", count=1, now=0.0))
    pool.check_reported("a", a_units)

    error = rejected(pool.check_reported, "a", [*a_units, 999])
    assert (error.status, error.kind, error.detail) == (422, "unknown_unit", {"unit_id": 999})
    assert "999" in error.error

    error = rejected(pool.check_reported, "a", b_units)
    assert (error.status, error.kind) == (422, "unit_not_leased")
    assert error.detail == {
        "unit_id": b_units[0],
        "worker_id": "a",
        "holder": "b",
        "state": "leased",
    }
    assert str(b_units[0]) in error.error and "'b'" in error.error

    pool.release_worker("b")
    error = rejected(pool.check_reported, "b", b_units)
    assert error.detail["holder"] is None and error.detail["state"] == "free"

    error = rejected(pool.check_reported, "a", [a_units[0], a_units[0]])
    assert (error.kind, error.detail) == ("invalid_request", {"field": "unit_ids"})
    for bad in ("12", [True], [1.5], [0]):
        assert rejected(pool.check_reported, "a", bad).detail == {"field": "unit_ids"}


def test_a_retried_report_of_a_committed_unit_is_accepted_and_not_counted_twice(
    pool: WorkPool,
) -> None:
    pool.register("d", length=40, shuffle_seed=0, unit_size=10)
    units = unit_ids(pool.lease("a", "d", count=2, now=0.0))
    assert pool.complete(units, round_number=3, worker_id="a") == 2
    pool.check_reported("a", units)  # the same submission again, after a lost answer
    assert pool.complete(units, round_number=4, worker_id="a") == 0
    assert [(c["unit_id"], c["round"], c["worker_id"]) for c in pool.completions()] == [
        (units[0], 3, "a"),
        (units[1], 3, "a"),
    ]
    error = rejected(pool.check_reported, "b", units[:1])
    assert error.detail["state"] == "completed" and error.detail["holder"] == "a"
    assert pool.release_worker("a") == 0  # completed units are not leases any more


def test_a_round_completes_units_whose_worker_was_evicted_after_submitting(
    pool: WorkPool,
) -> None:
    pool.register("d", length=20, shuffle_seed=0, unit_size=10)
    units = unit_ids(pool.lease("a", "d", count=2, now=0.0))
    pool.check_reported("a", units)
    pool.release_worker("a")  # evicted while its round waited for others
    assert pool.complete([*units, 12345], round_number=1, worker_id="a") == 2
    assert pool.lease("b", "d", count=1, now=1.0)["status"] == "exhausted"


def test_rollback_after_returns_units_of_lost_rounds_to_the_pool(pool: WorkPool) -> None:
    pool.register("d", length=60, shuffle_seed=0, unit_size=10)
    for round_number in (1, 2, 3):
        units = unit_ids(pool.lease("a", "d", count=2, now=float(round_number)))
        pool.complete(units, round_number=round_number, worker_id="a")
    assert pool.rollback_after(1) == 4
    assert [c["index"] for c in pool.completions("d")] == [0, 1]
    again = pool.lease("b", "d", count=10, now=9.0)
    assert positions(again) == [(0, 2), (0, 3), (0, 4), (0, 5)]
    assert pool.rollback_after(1) == 0
    pool.check_reported("b", unit_ids(again))


def test_progress_counts_units_of_every_dataset_and_epoch(pool: WorkPool) -> None:
    pool.register("a", length=95, shuffle_seed=0, unit_size=10)
    pool.register("b", length=5, shuffle_seed=0, unit_size=10)
    units = unit_ids(pool.lease("w", "a", count=4, now=0.0))
    pool.complete(units[:1], round_number=0)
    pool.lease("w", "b", count=4, now=0.0)
    assert pool.progress() == [
        {"dataset_id": "a", "epoch": 0, "total": 10, "completed": 1, "leased": 3, "free": 6},
        {"dataset_id": "b", "epoch": 0, "total": 1, "completed": 0, "leased": 1, "free": 0},
    ]
    assert [u["dataset_id"] for u in pool.leases_of("w")] == ["a", "a", "a", "b"]
    (with_indices,) = [u for u in pool.leases_of("w", indices=True) if u["dataset_id"] == "b"]
    assert sorted(with_indices["indices"]) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------- durability and transactions


def test_state_survives_closing_and_reopening_the_database(tmp_path: Path) -> None:
    conn, pool = open_pool(tmp_path / "state.db")
    with immediate(conn):
        pool.register("d", length=100, shuffle_seed=5, unit_size=10)
        first = pool.lease("a", "d", count=3, now=1.0)
        pool.complete(unit_ids(first)[:1], round_number=1, worker_id="a")
    conn.close()

    conn, pool = open_pool(tmp_path / "state.db")
    assert pool.register("d", length=100, shuffle_seed=5, unit_size=10)["epoch"] == 0
    assert [u["unit_id"] for u in pool.leases_of("a")] == unit_ids(first)[1:]
    assert len(pool.completions()) == 1
    with immediate(conn):
        second = pool.lease("b", "d", count=1, now=2.0)
    assert positions(second) == [(0, 3)]
    assert min(unit_ids(second)) > max(unit_ids(first))
    conn.close()


def test_the_pool_never_commits_on_its_own(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    conn, pool = open_pool(path)
    with immediate(conn):
        pool.register("d", length=100, shuffle_seed=5, unit_size=10)
    conn.execute("CREATE TABLE rounds (number INTEGER PRIMARY KEY)")
    conn.commit()
    units = unit_ids(pool.lease("a", "d", count=2, now=0.0))
    conn.commit()

    with pytest.raises(RuntimeError), immediate(conn):  # the round's commit row fails
        conn.execute("INSERT INTO rounds VALUES (1)")
        assert pool.complete(units, round_number=1) == 2
        raise RuntimeError("disk full")
    assert pool.completions() == []

    pool.complete(units, round_number=1)  # left uncommitted: gone when the process dies
    conn.close()
    conn, pool = open_pool(path)
    assert pool.completions() == []
    assert len(pool.leases_of("a")) == 2
    conn.close()


# ---------------------------------------------------------------------- random histories

WORKERS = ["w0", "w1", "w2"]
operation = st.one_of(
    st.tuples(st.just("lease"), st.sampled_from(WORKERS), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(WORKERS)),
    st.tuples(st.just("commit"), st.sampled_from(WORKERS)),
    st.tuples(st.just("retry"), st.sampled_from(WORKERS)),
    st.tuples(st.just("crash"), st.integers(0, 3)),
    st.tuples(st.just("steal"), st.sampled_from(WORKERS), st.sampled_from(WORKERS)),
)


class History:
    """Drives a pool like a coordinator would and checks every answer against a small model."""

    def __init__(self, pool: WorkPool) -> None:
        self.pool = pool
        self.round = 0
        self.held: dict[str, set[int]] = {worker: set() for worker in WORKERS}
        self.last_commit: dict[str, list[int]] = {worker: [] for worker in WORKERS}
        self.completed: dict[int, int] = {}  # unit_id -> round
        self.completed_by: dict[int, str] = {}  # unit_id -> the worker whose commit holds it

    def run(self, op: tuple) -> None:
        getattr(self, op[0])(*op[1:])
        leased = {u for units in self.held.values() for u in units}
        counted = sum(p["leased"] for p in self.pool.progress())
        assert counted == len(leased)
        assert sum(p["completed"] for p in self.pool.progress()) == len(self.completed)

    def lease(self, worker: str, count: int, open_next: bool) -> None:
        answer = self.pool.lease(
            worker, "d", count, now=float(self.round), open_next_epoch=open_next
        )
        got = set(unit_ids(answer))
        assert not got & set(self.completed)
        assert all(not got & units for units in self.held.values())
        self.held[worker] |= got

    def release(self, worker: str) -> None:
        assert self.pool.release_worker(worker) == len(self.held[worker])
        self.held[worker] = set()

    def commit(self, worker: str) -> None:
        reported = sorted(self.held[worker])
        self.pool.check_reported(worker, reported)
        self.round += 1
        assert self.pool.complete(reported, self.round, worker_id=worker) == len(reported)
        self.completed.update(dict.fromkeys(reported, self.round))
        self.completed_by.update(dict.fromkeys(reported, worker))
        self.held[worker] = set()
        self.last_commit[worker] = reported

    def retry(self, worker: str) -> None:
        # what its last commit completed and still holds: a unit a crash gave back and another
        # worker then completed is that worker's, and refused to this one (unit_not_leased)
        reported = [u for u in self.last_commit[worker] if self.completed_by.get(u) == worker]
        self.pool.check_reported(worker, reported)
        assert self.pool.complete(reported, self.round, worker_id=worker) == 0

    def crash(self, lost: int) -> None:
        self.round = max(0, self.round - lost)
        freed = {u for u, r in self.completed.items() if r > self.round}
        assert self.pool.rollback_after(self.round) == len(freed)
        self.completed = {u: r for u, r in self.completed.items() if r <= self.round}
        self.completed_by = {u: w for u, w in self.completed_by.items() if u in self.completed}

    def steal(self, thief: str, owner: str) -> None:
        if thief != owner and self.held[owner]:
            error = rejected(self.pool.check_reported, thief, [min(self.held[owner])])
            assert (error.kind, error.detail["holder"]) == ("unit_not_leased", owner)

    def drain(self) -> None:
        for worker in WORKERS:
            self.release(worker)
        while (answer := self.pool.lease("w0", "d", 1024, now=0.0))["status"] == "leased":
            self.held["w0"] |= set(unit_ids(answer))
            self.commit("w0")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    length=st.integers(1, 40),
    unit_size=st.integers(1, 7),
    ops=st.lists(operation, max_size=30),
)
def test_random_histories_train_every_sample_exactly_once_per_epoch(
    length: int, unit_size: int, ops: list[tuple]
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        conn, pool = open_pool(Path(folder) / "state.db")
        pool.register("d", length=length, shuffle_seed=length * 31 + unit_size, unit_size=unit_size)
        conn.commit()
        history = History(pool)
        for op in ops:
            with immediate(conn):
                history.run(op)
        with immediate(conn):
            history.drain()
        conn.close()

        conn, pool = open_pool(Path(folder) / "state.db")
        epochs = pool.progress("d")
        assert all(p["completed"] == p["total"] and p["leased"] == 0 for p in epochs)
        shape = pool.dataset("d")
        for p in epochs:
            done = [c for c in pool.completions("d") if c["epoch"] == p["epoch"]]
            assert [c["index"] for c in done] == list(range(shape["units_per_epoch"]))
            samples = [i for c in done for i in pool.indices(shape, c["epoch"], c["index"])]
            assert sorted(samples) == list(range(length))
        conn.close()


def test_a_retry_after_a_crash_gave_its_unit_to_another_worker_is_refused_that_unit() -> None:
    """Found by the random histories: w0 completes a unit in round 1, a crash loses round 1
    (the unit goes back), w1 leases and completes it; w0 then retries its round reporting
    that unit, which is w1's now: refused (unit_not_leased, held by w1), counted once."""
    with tempfile.TemporaryDirectory() as folder:
        conn, pool = open_pool(Path(folder) / "state.db")
        pool.register("d", length=4, shuffle_seed=0, unit_size=2)
        conn.commit()
        history = History(pool)
        for op in [("lease", "w0", 1, False), ("commit", "w0"), ("crash", 1),
                   ("lease", "w1", 1, False), ("commit", "w1")]:  # fmt: skip
            with immediate(conn):
                history.run(op)
        (unit,) = history.last_commit["w0"]
        assert history.last_commit["w1"] == [unit] and history.completed_by == {unit: "w1"}
        error = rejected(pool.check_reported, "w0", [unit])
        assert (error.kind, error.detail["holder"], error.detail["state"]) == (
            "unit_not_leased",
            "w1",
            "completed",
        )
        with immediate(conn):
            history.run(("retry", "w0"))  # it reports nothing of it
        assert sum(p["completed"] for p in pool.progress()) == 1
        conn.close()


# ---------------------------------------------------------------------- partly trained units


def test_a_released_unit_leases_only_its_untrained_rest_and_rollback_restores_it(
    pool: WorkPool,
) -> None:
    """Unit 1 (10 samples) trained 4 then 7 by rounds 3 and 5, then released: the next lease
    hands out samples 7..9 with start 7. Rolling back past round 3 restores the whole unit."""
    pool.register("ds", 20, 1, 10)
    first = pool.lease("a", "ds", 1, now=0.0)["units"][0]
    assert first["start"] == 0 and len(first["indices"]) == 10
    all_indices = first["indices"]
    assert pool.advance({first["unit_id"]: 4}, 3) == 1
    assert pool.advance({first["unit_id"]: 3}, 4) == 0  # an older report changes nothing
    assert pool.advance({first["unit_id"]: 7}, 5) == 1
    assert pool.unit(first["unit_id"])["trained"] == 7
    assert pool.lease_bodies("a", "ds")[0]["indices"] == all_indices[7:]
    assert pool.release_units([first["unit_id"]]) == 1
    again = pool.lease("b", "ds", 1, now=1.0)["units"][0]
    assert (again["unit_id"], again["start"], again["indices"]) == (
        first["unit_id"],
        7,
        all_indices[7:],
    )
    pool.rollback_after(4)  # round 5 is lost: back to 4 trained
    assert pool.unit(first["unit_id"])["trained"] == 4
    pool.rollback_after(2)  # round 3 is lost too
    assert pool.unit(first["unit_id"])["trained"] == 0


def test_partial_reports_are_checked_against_the_unit_and_its_holder(pool: WorkPool) -> None:
    pool.register("ds", 13, 1, 10)  # unit 2 is short: 3 samples
    units = [u["unit_id"] for u in pool.lease("a", "ds", 2, now=0.0)["units"]]
    pool.check_progress("a", {units[0]: 9, units[1]: 2})
    for progress in ({units[0]: 10}, {units[1]: 3}, {units[0]: 0}):
        error = rejected(pool.check_progress, "a", progress)
        assert (error.status, error.kind) == (422, "invalid_request")
        assert "partly trained unit reports" in error.error
    error = rejected(pool.check_progress, "b", {units[0]: 5})
    assert error.kind == "unit_not_leased"
    pool.complete([units[0]], 1)
    assert pool.advance({units[0]: 5}, 2) == 0  # a completed unit keeps its state
