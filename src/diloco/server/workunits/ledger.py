"""The work-unit ledger: the units a submission reports, and what committed rounds make of them.

The half of the pool that rounds drive: the checks that reported units (and partial counts)
are the worker's own, completion and trained prefixes inside the transaction that commits a
round (`CommitRecord.apply_to`), the release of a departed worker's partly trained units once
that round committed, and the rollback of rounds a crash lost. Apart from the leases
(`workunit_leases`) because nothing here hands a unit out or reads an epoch's order; both
stand on `workunit_reads.UnitReads`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from diloco.server.errors import Rejection
from diloco.server.workunits.reads import UnitReads
from diloco.server.workunits.schema import check_unit_ids, check_worker_id

log = logging.getLogger("diloco.server")


class UnitLedger(UnitReads):
    """Checks reported units and completes them at commit: the pool as a round sees it."""

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
