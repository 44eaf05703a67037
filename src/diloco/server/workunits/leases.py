"""Work-unit leases: datasets registered, free units leased to workers, a worker's units freed.

The half of the pool that registration, lease requests and evictions drive: a dataset's shape
(fixed once registered), a lease (released units first, then new rows above an epoch's
cursor; a retried lease_key answered with the same units), the next epoch opened on request,
and a departing worker's unfinished units back to the pool. Apart from the ledger
(`workunit_ledger`) because nothing here knows of rounds: a unit is completed, and its
trained prefix recorded, only there. Both stand on `workunit_reads.UnitReads`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from diloco.server.errors import Rejection
from diloco.server.workunits.reads import UnitReads
from diloco.server.workunits.schema import (
    MAX_LEASE_COUNT,
    MAX_LEASE_SAMPLES,
    MAX_LENGTH,
    MAX_SEED,
    MAX_UNIT_SIZE,
    REMEMBERED_LEASES,
    check_dataset_id,
    check_int,
    check_worker_id,
    invalid,
)


class UnitLeases(UnitReads):
    """Registers datasets and leases their units: the pool as a lease request sees it."""

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
