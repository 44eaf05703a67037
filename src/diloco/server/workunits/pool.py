"""Work units: the server's record of which training samples are leased, trained and pending.

A worker registers a dataset by (dataset_id, length, shuffle_seed, unit_size). Epoch e of the
dataset is the order `Permutation(length, shuffle_seed, e)` (every epoch, 0 included, derives
its own keys from the pair), cut into units of `unit_size` consecutive positions; the last unit
may be shorter. A unit is leased to one worker at a time and counts as completed only when the
round that trained it commits, so after any crash every sample of an epoch is trained once.

A unit may also be trained in part: a submission reports `unit:count`, the count of its
samples trained so far (from the unit's first), and the round that commits it records the
unit's `trained` prefix. A unit that goes back to the pool keeps its prefix, and its next lease
hands out only the rest, so no sample is trained twice whoever trains the unit next.

Units are created lazily: an epoch is a cursor `next_unit` (units below it have a row) and a
row per unit ever leased, so a dataset of 1e9 samples costs nothing until it is trained. A
released unit keeps its row in state 'free' and its stable unit_id, and is leased again before
any unit above the cursor (oldest epoch first, then lowest index).

All state lives in `wu_*` tables of the SQLite connection given. The pool never begins or
commits a transaction: `complete` runs inside the transaction that commits a round, so the
round and its units are durable together. `schema.immediate(conn)` is there for
callers (and tests) that want a write transaction of their own.

`WorkPool` is one class in three parts: the reads (datasets, units, a unit's sample indices,
progress); the leases that registration, lease requests and evictions drive (nothing there
knows of rounds); and the ledger that rounds drive (the checks of reported units and partial
counts, completion and trained prefixes at commit, rollback of rounds a crash lost). The
writing parts call nothing of each other's, only the reads. The tables, bounds and request
checks are in schema.py.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Sequence

from diloco.algorithm.permutation import Permutation
from diloco.server.errors import Rejection
from diloco.server.workunits.schema import (
    MAX_LEASE_COUNT,
    MAX_LEASE_SAMPLES,
    MAX_LENGTH,
    MAX_SEED,
    MAX_UNIT_SIZE,
    REMEMBERED_LEASES,
    UNIT_COLUMNS,
    check_dataset_id,
    check_int,
    check_unit_ids,
    check_worker_id,
    create_tables,
    invalid,
)

log = logging.getLogger("diloco.server")


class WorkPool:
    """Leases, completions and progress of every registered dataset, on one SQLite connection."""

    # --------------------------------------------------------------------------- reads

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._permutations: dict[tuple[str, int], Permutation] = {}
        create_tables(conn)

    def dataset(self, dataset_id: str) -> dict:
        """A registered dataset's shape and its newest open epoch; 404 when unknown."""
        row = self._require_dataset(dataset_id)
        return {**row, "epoch": self._newest_epoch(dataset_id)}

    def datasets(self) -> list[str]:
        rows = self.conn.execute("SELECT dataset_id FROM wu_datasets ORDER BY dataset_id")
        return [dataset_id for (dataset_id,) in rows]

    def progress(self, dataset_id: str | None = None) -> list[dict]:
        """Per dataset and epoch: units in total, completed, leased and free."""
        if dataset_id is not None:
            self._require_dataset(dataset_id)
        chosen = dataset_id is not None
        where, args = ("WHERE e.dataset_id = ?", (dataset_id,)) if chosen else ("", ())
        epochs = self.conn.execute(
            "SELECT e.dataset_id, e.epoch, d.units_per_epoch FROM wu_epochs e"
            f" JOIN wu_datasets d USING (dataset_id) {where} ORDER BY e.dataset_id, e.epoch",
            args,
        ).fetchall()
        where = "WHERE dataset_id = ?" if chosen else ""
        counts: dict[tuple[str, int, str], int] = {
            (ds, epoch, state): n
            for ds, epoch, state, n in self.conn.execute(
                "SELECT dataset_id, epoch, state, COUNT(*) FROM wu_units"
                f" {where} GROUP BY dataset_id, epoch, state",
                args,
            )
        }
        report = []
        for ds, epoch, total in epochs:
            completed = counts.get((ds, epoch, "completed"), 0)
            leased = counts.get((ds, epoch, "leased"), 0)
            report.append(
                {
                    "dataset_id": ds,
                    "epoch": epoch,
                    "total": total,
                    "completed": completed,
                    "leased": leased,
                    "free": total - completed - leased,
                }
            )
        return report

    def completions(self, dataset_id: str | None = None) -> list[dict]:
        """Every completed unit with its round, in (dataset, epoch, index) order: for audits."""
        where, args = ("AND dataset_id = ?", (dataset_id,)) if dataset_id is not None else ("", ())
        rows = self.conn.execute(
            f"SELECT {UNIT_COLUMNS} FROM wu_units WHERE state = 'completed' {where}"
            " ORDER BY dataset_id, epoch, unit_index",
            args,
        ).fetchall()
        return [self._unit_dict(row) for row in rows]

    def unit(self, unit_id: int) -> dict | None:
        """One unit's row (no indices), or None."""
        row = self.conn.execute(
            f"SELECT {UNIT_COLUMNS} FROM wu_units WHERE unit_id = ?", (unit_id,)
        ).fetchone()
        return None if row is None else self._unit_dict(row)

    def leases_of(self, worker_id: str, *, indices: bool = False) -> list[dict]:
        """The units a worker holds now, oldest lease first; with their indices on request."""
        rows = self.conn.execute(
            f"SELECT {UNIT_COLUMNS} FROM wu_units WHERE worker_id = ? AND state = 'leased'"
            " ORDER BY unit_id",
            (worker_id,),
        ).fetchall()
        leases = []
        for row in rows:
            unit = self._unit_dict(row)
            if indices:
                shape = self._require_dataset(unit["dataset_id"])
                unit["indices"] = self.indices(shape, unit["epoch"], unit["index"])[
                    unit["trained"] :
                ]
            leases.append(unit)
        return leases

    def lease_bodies(self, worker_id: str, dataset_id: str) -> list[dict]:
        """The units of `dataset_id` leased to a worker now, as a lease answers them (the
        samples still to train, from `start`), oldest lease first."""
        shape = self._require_dataset(dataset_id)
        return [
            self._unit_body(shape, u["unit_id"], u["epoch"], u["index"], u["trained"])
            for u in self.leases_of(worker_id)
            if u["dataset_id"] == dataset_id
        ]

    def indices(self, shape: dict, epoch: int, index: int) -> list[int]:
        """The sample indices of unit `index` of an epoch: unit_size permutation calls."""
        dataset_id, length, unit_size = shape["dataset_id"], shape["length"], shape["unit_size"]
        permutation = self._permutations.get((dataset_id, epoch))
        if permutation is None:
            permutation = Permutation(length, shape["shuffle_seed"], epoch)
            if len(self._permutations) >= 64:
                self._permutations.clear()
            self._permutations[(dataset_id, epoch)] = permutation
        start = index * unit_size
        return permutation.indices(start, min(start + unit_size, length))

    def unit_length(self, unit: dict) -> int:
        """How many samples a unit has (the last one of an epoch may be short)."""
        shape = self._require_dataset(unit["dataset_id"])
        first = unit["index"] * shape["unit_size"]
        return min(shape["unit_size"], shape["length"] - first)

    # ------------------------------------------------------------------ internals

    def _dataset_row(self, dataset_id: str) -> dict | None:
        row = self.conn.execute(
            "SELECT dataset_id, length, unit_size, shuffle_seed, units_per_epoch"
            " FROM wu_datasets WHERE dataset_id = ?",
            (dataset_id,),
        ).fetchone()
        if row is None:
            return None
        keys = ("dataset_id", "length", "unit_size", "shuffle_seed", "units_per_epoch")
        return dict(zip(keys, row, strict=True))

    def _require_dataset(self, dataset_id: str) -> dict:
        row = self._dataset_row(dataset_id)
        if row is None:
            raise Rejection(
                404,
                "unknown_dataset",
                f"no dataset {dataset_id!r} is registered",
                dataset_id=dataset_id,
            )
        return row

    def _newest_epoch(self, dataset_id: str) -> int:
        (epoch,) = self.conn.execute(
            "SELECT MAX(epoch) FROM wu_epochs WHERE dataset_id = ?", (dataset_id,)
        ).fetchone()
        return epoch

    def _unit_body(
        self, shape: dict, unit_id: int, epoch: int, index: int, trained: int = 0
    ) -> dict:
        """A leased unit as the worker gets it: `indices` are the samples still to train, from
        position `start` of the unit (its prefix before `start` was trained already)."""
        return {
            "unit_id": unit_id,
            "epoch": epoch,
            "index": index,
            "start": trained,
            "indices": self.indices(shape, epoch, index)[trained:],
        }

    def _units_by_id(self, unit_ids: list[int]) -> dict[int, dict]:
        found: dict[int, dict] = {}
        for start in range(0, len(unit_ids), 500):  # stays under SQLite's variable limit
            chunk = unit_ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self.conn.execute(
                f"SELECT {UNIT_COLUMNS} FROM wu_units WHERE unit_id IN ({marks})", chunk
            )
            for row in rows:
                found[row[0]] = self._unit_dict(row)
        return found

    @staticmethod
    def _unit_dict(row: tuple) -> dict:
        unit_id, dataset_id, epoch, index, state, worker_id, leased_at, completed_round, trained = (
            row
        )
        return {
            "unit_id": unit_id,
            "dataset_id": dataset_id,
            "epoch": epoch,
            "index": index,
            "state": state,
            "worker_id": worker_id,
            "leased_at": leased_at,
            "round": completed_round,
            "trained": trained,
        }

    # -------------------- leases: datasets registered, units handed out and given back

    def register(self, dataset_id: str, length: int, shuffle_seed: int, unit_size: int) -> dict:
        """Adds a dataset, or answers its state when it is already known with the same shape.

        The shape must never change under a dataset_id: units already completed name positions
        of the old order, so another length, unit size or seed would skip or repeat samples.
        """
        check_dataset_id(dataset_id)
        given = {
            "length": check_int("length", length, 1, MAX_LENGTH),
            "unit_size": check_int("unit_size", unit_size, 1, MAX_UNIT_SIZE),
            "shuffle_seed": check_int("shuffle_seed", shuffle_seed, 0, MAX_SEED),
        }
        stored = self._dataset_row(dataset_id)
        if stored is None:
            units = -(-length // unit_size)
            self.conn.execute(
                "INSERT INTO wu_datasets (dataset_id, length, unit_size, shuffle_seed,"
                " units_per_epoch) VALUES (?, ?, ?, ?, ?)",
                (dataset_id, length, unit_size, shuffle_seed, units),
            )
            self.conn.execute(
                "INSERT INTO wu_epochs (dataset_id, epoch, next_unit) VALUES (?, 0, 0)",
                (dataset_id,),
            )
            return self.dataset(dataset_id)
        for field, value in given.items():
            if stored[field] != value:
                raise Rejection(
                    409,
                    "dataset_conflict",
                    f"dataset {dataset_id!r} is registered with {field}={stored[field]},"
                    f" not {value}",
                    dataset_id=dataset_id,
                    field=field,
                    expected=stored[field],
                    got=value,
                )
        return self.dataset(dataset_id)

    def lease(
        self,
        worker_id: str,
        dataset_id: str,
        count: int,
        now: float,
        open_next_epoch: bool = False,
        lease_key: str | None = None,
    ) -> dict:
        """Leases up to `count` free units to a worker: released ones first, oldest epoch first.

        `lease_key` makes a retried request idempotent: if the answer was lost (a crash right
        after the commit, a dropped connection), the same key gets the same units back instead
        of new ones, so no unit stays leased to a worker that never learnt of it.

        When nothing is free the answer is 'exhausted', unless the worker asks to open the next
        epoch. Units still leased to others are not free: they may come back, so an epoch is
        only opened on request. One lease holds at most MAX_LEASE_SAMPLES indices.
        """
        check_worker_id(worker_id)
        check_dataset_id(dataset_id)
        check_int("count", count, 1, MAX_LEASE_COUNT)
        shape = self._require_dataset(dataset_id)
        if lease_key is not None:
            replay = self._replay(worker_id, lease_key, dataset_id, shape)
            if replay is not None:
                return replay
        count = min(count, max(1, MAX_LEASE_SAMPLES // shape["unit_size"]))
        picked: list[tuple[int, int, int, int]] = []  # (unit_id, epoch, index, trained)
        epochs = self.conn.execute(
            "SELECT epoch, next_unit FROM wu_epochs WHERE dataset_id = ? ORDER BY epoch",
            (dataset_id,),
        ).fetchall()
        holder = (worker_id, now)
        for epoch, next_unit in epochs:
            if len(picked) >= count:
                break
            picked += self._take_free(dataset_id, epoch, count - len(picked), holder)
            picked += self._take_new(shape, epoch, next_unit, count - len(picked), holder)
        if not picked and open_next_epoch:
            epoch = epochs[-1][0] + 1
            self.conn.execute(
                "INSERT INTO wu_epochs (dataset_id, epoch, next_unit) VALUES (?, ?, 0)",
                (dataset_id, epoch),
            )
            picked += self._take_new(shape, epoch, 0, count, holder)
        if lease_key is not None:
            self._remember(worker_id, lease_key, dataset_id, [unit[0] for unit in picked], now)
        return {
            "status": "leased" if picked else "exhausted",
            "dataset_id": dataset_id,
            "epoch": self._newest_epoch(dataset_id),
            "units": [self._unit_body(shape, *unit) for unit in picked],
        }

    def _remember(
        self, worker_id: str, lease_key: str, dataset_id: str, unit_ids: list[int], now: float
    ) -> None:
        self.conn.execute(
            "INSERT INTO wu_lease_requests (worker_id, lease_key, dataset_id, units, at)"
            " VALUES (?, ?, ?, ?, ?)",
            (worker_id, lease_key, dataset_id, json.dumps(unit_ids), now),
        )
        self.conn.execute(  # a retry only ever repeats one of the last few requests
            "DELETE FROM wu_lease_requests WHERE worker_id = ? AND rowid NOT IN (SELECT rowid"
            " FROM wu_lease_requests WHERE worker_id = ? ORDER BY at DESC LIMIT ?)",
            (worker_id, worker_id, REMEMBERED_LEASES),
        )

    def _replay(self, worker_id: str, lease_key: str, dataset_id: str, shape: dict) -> dict | None:
        """The answer to an earlier request with this key: its units still leased to us."""
        row = self.conn.execute(
            "SELECT dataset_id, units FROM wu_lease_requests WHERE worker_id = ? AND lease_key = ?",
            (worker_id, lease_key),
        ).fetchone()
        if row is None:
            return None
        if row[0] != dataset_id:
            raise invalid("lease_key", f"lease_key {lease_key!r} was used for {row[0]!r}")
        units = []
        for unit_id in json.loads(row[1]):
            unit = self.unit(unit_id)
            if unit is not None and unit["state"] == "leased" and unit["worker_id"] == worker_id:
                units.append(
                    self._unit_body(shape, unit_id, unit["epoch"], unit["index"], unit["trained"])
                )
        return {
            "status": "leased" if units else "exhausted",
            "dataset_id": dataset_id,
            "epoch": self._newest_epoch(dataset_id),
            "units": units,
        }

    def release_worker(self, worker_id: str, keep: Iterable[int] = ()) -> int:
        """Returns a worker's unfinished units to the pool (eviction, deregistration).

        `keep`: units the worker reported with a submission that stays in the open round; that
        round trained them and completes them when it commits, so they are not leased again.
        """
        kept = sorted(set(keep))
        marks = ",".join("?" * len(kept))
        cursor = self.conn.execute(
            "UPDATE wu_units SET state = 'free', worker_id = NULL, leased_at = NULL"
            " WHERE worker_id = ? AND state = 'leased'"
            + (f" AND unit_id NOT IN ({marks})" if kept else ""),
            (worker_id, *kept),
        )
        return cursor.rowcount

    # ------------------------------------------------------------------ internals

    def _take_free(
        self, dataset_id: str, epoch: int, count: int, holder: tuple[str, float]
    ) -> list[tuple[int, int, int, int]]:
        """Leases released units of an epoch, lowest index first (all lie below its cursor)."""
        if count <= 0:
            return []
        rows = self.conn.execute(
            "SELECT unit_id, unit_index, trained FROM wu_units"
            " WHERE dataset_id = ? AND epoch = ? AND state = 'free'"
            " ORDER BY unit_index LIMIT ?",
            (dataset_id, epoch, count),
        ).fetchall()
        self.conn.executemany(
            "UPDATE wu_units SET state = 'leased', worker_id = ?, leased_at = ? WHERE unit_id = ?",
            [(*holder, unit_id) for unit_id, _, _ in rows],
        )
        return [(unit_id, epoch, index, trained) for unit_id, index, trained in rows]

    def _take_new(
        self, shape: dict, epoch: int, next_unit: int, count: int, holder: tuple[str, float]
    ) -> list[tuple[int, int, int, int]]:
        """Leases the next `count` never-leased units of an epoch: new rows, cursor moved on."""
        stop = min(shape["units_per_epoch"], next_unit + max(0, count))
        if stop <= next_unit:
            return []
        dataset_id = shape["dataset_id"]
        taken = []
        for index in range(next_unit, stop):
            cursor = self.conn.execute(
                "INSERT INTO wu_units (dataset_id, epoch, unit_index, state, worker_id,"
                " leased_at) VALUES (?, ?, ?, 'leased', ?, ?)",
                (dataset_id, epoch, index, *holder),
            )
            taken.append((cursor.lastrowid, epoch, index, 0))
        self.conn.execute(
            "UPDATE wu_epochs SET next_unit = ? WHERE dataset_id = ? AND epoch = ?",
            (stop, dataset_id, epoch),
        )
        return taken

    # --------------------------------- the ledger: reported units, completed at commit

    def leased_to(self, worker_id: str, unit_ids: Sequence[int]) -> list[int]:
        """Those of `unit_ids` that are leased to `worker_id` and not completed yet."""
        rows = self._units_by_id(check_unit_ids(unit_ids))
        return [
            unit_id
            for unit_id, row in sorted(rows.items())
            if row["worker_id"] == worker_id and row["state"] == "leased"
        ]

    def check_reported(self, worker_id: str, unit_ids: Sequence[int]) -> None:
        """Refuses a submission that reports units the worker does not hold.

        A unit this same worker already completed is accepted: a retried submission of a round
        that committed reports it again, and `complete` will not count it twice.
        """
        check_worker_id(worker_id)
        ids = check_unit_ids(unit_ids)
        rows = self._units_by_id(ids)
        for unit_id in ids:
            row = rows.get(unit_id)
            if row is None:
                raise Rejection(
                    422, "unknown_unit", f"no work unit has id {unit_id}", unit_id=unit_id
                )
            if row["worker_id"] == worker_id and row["state"] in ("leased", "completed"):
                continue
            holder = row["worker_id"]
            state = row["state"]
            whom = "nobody" if holder is None else f"worker {holder!r}"
            raise Rejection(
                422,
                "unit_not_leased",
                f"work unit {unit_id} is not leased to worker {worker_id!r}:"
                f" it is {state}, held by {whom}",
                unit_id=unit_id,
                worker_id=worker_id,
                holder=holder,
                state=state,
            )

    def complete(
        self, unit_ids: Sequence[int], round_number: int, worker_id: str | None = None
    ) -> int:
        """Marks units completed by a committed round; returns how many were not completed yet.

        Whatever the unit's lease state now (its worker may have been evicted after it
        submitted), the round trained it, so it is completed. A unit completed earlier keeps
        its first round. `worker_id`, when given, is recorded as who trained it.
        """
        if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
            raise ValueError(f"round_number must be an integer >= 0, got {round_number!r}")
        ids = list(dict.fromkeys(int(unit_id) for unit_id in unit_ids))
        rows = self._units_by_id(ids)
        missing = [unit_id for unit_id in ids if unit_id not in rows]
        if missing:
            log.warning("round %d completes unknown work units %s", round_number, missing[:10])
        fresh = [unit_id for unit_id, row in rows.items() if row["state"] != "completed"]
        self.conn.executemany(
            "UPDATE wu_units SET state = 'completed', completed_round = ?,"
            " worker_id = COALESCE(?, worker_id) WHERE unit_id = ?",
            [(round_number, worker_id, unit_id) for unit_id in fresh],
        )
        return len(fresh)

    def check_progress(self, worker_id: str, progress: dict[int, int]) -> None:
        """Refuses partial reports (unit -> samples of it trained so far) that name a unit the
        worker does not hold, or a count outside 1..(its length - 1)."""
        self.check_reported(worker_id, list(progress))
        rows = self._units_by_id(list(progress))
        for unit_id, count in progress.items():
            length = self.unit_length(rows[unit_id])
            if isinstance(count, bool) or not isinstance(count, int) or not 0 < count < length:
                raise Rejection(
                    422,
                    "invalid_request",
                    f"field 'units': unit {unit_id} has {length} samples; a partly trained "
                    f"unit reports 1..{length - 1} of them, got {count}",
                    field="units",
                    unit_id=unit_id,
                    got=count,
                )

    def advance(self, progress: dict[int, int], round_number: int) -> int:
        """Record the trained prefixes a committed round carries; returns how many moved.

        A prefix only grows (a retry or an older report changes nothing), and a completed unit
        is left alone. Each move is logged for `rollback_after`."""
        moved = 0
        rows = self._units_by_id(sorted(progress))
        for unit_id, count in sorted(progress.items()):
            row = rows.get(unit_id)
            if row is None or row["state"] == "completed" or count <= row["trained"]:
                continue
            self.conn.execute(
                "INSERT OR REPLACE INTO wu_progress (round, unit_id, before, after)"
                " VALUES (?, ?, ?, ?)",
                (round_number, unit_id, row["trained"], count),
            )
            self.conn.execute("UPDATE wu_units SET trained = ? WHERE unit_id = ?", (count, unit_id))
            moved += 1
        return moved

    def release_units(self, unit_ids: Sequence[int]) -> int:
        """Returns leased units to the pool (their trained prefix stays): a departed worker's
        partly trained units, once the round that carried their prefix has committed."""
        ids = sorted(set(unit_ids))
        released = 0
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            cursor = self.conn.execute(
                "UPDATE wu_units SET state = 'free', worker_id = NULL, leased_at = NULL"
                f" WHERE state = 'leased' AND unit_id IN ({marks})",
                chunk,
            )
            released += cursor.rowcount
        return released

    def rollback_after(self, round_number: int) -> int:
        """Frees units completed in rounds above `round_number` and shrinks the prefixes those
        rounds trained back to what they were: a crash lost those rounds."""
        moves = self.conn.execute(
            "SELECT unit_id, before FROM wu_progress WHERE round > ? ORDER BY round DESC",
            (round_number,),
        ).fetchall()
        for unit_id, before in moves:  # newest first: each unit ends at its oldest `before`
            self.conn.execute(
                "UPDATE wu_units SET trained = ? WHERE unit_id = ?", (before, unit_id)
            )
        self.conn.execute("DELETE FROM wu_progress WHERE round > ?", (round_number,))
        cursor = self.conn.execute(
            "UPDATE wu_units SET state = 'free', worker_id = NULL, leased_at = NULL,"
            " completed_round = NULL WHERE state = 'completed' AND completed_round > ?",
            (round_number,),
        )
        return cursor.rowcount
