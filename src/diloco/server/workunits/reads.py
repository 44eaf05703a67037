"""The work-unit pool's reads: datasets, units, a unit's sample indices, progress and audits.

Both writing halves of the pool stand on these reads and on nothing of each other's: the
leases (`workunit_leases.UnitLeases`) answer a unit with its indices and look datasets up, the
ledger (`workunit_ledger.UnitLedger`) looks units up by id. So the reads live here, once, and
the coordinator's views (progress, completions, a worker's leases) with them. Nothing here
writes a row; the permutation cache is the only state.
"""

from __future__ import annotations

import sqlite3

from diloco.algorithm.permutation import Permutation
from diloco.server.errors import Rejection
from diloco.server.workunits.schema import UNIT_COLUMNS


class UnitReads:
    """The `wu_*` tables of one SQLite connection, read: datasets, units, epochs' orders."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._permutations: dict[tuple[str, int], Permutation] = {}

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
