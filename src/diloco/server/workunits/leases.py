"""The data leases: which work units of which dataset each worker trains.

The work-unit pool (`workunits.WorkPool`) is the durable ledger; this is the coordinator's door
to it: a dataset's registration (audited), leases in one transaction each, and the checks that
a submission's reported units are the worker's own. Completion is not here: units complete in
the transaction of the outer step that carries them (`CommitRecord.apply_to`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from diloco import faults
from diloco.server.state.store import StateStore
from diloco.server.workunits.pool import WorkPool


class DataLeases:
    """Datasets and leases, through the pool, in the state store's transactions."""

    def __init__(self, pool: WorkPool, state: StateStore) -> None:
        self.pool = pool
        self.state = state

    def register(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict:
        """A worker states its dataset; the same id with another shape is a 409."""
        with self.state.transaction():
            known = dataset_id in self.pool.datasets()
            answer = self.pool.register(dataset_id, length, shuffle_seed, unit_size)
            if not known:
                self.state.audit(
                    "dataset_registered",
                    worker_id=worker_id,
                    dataset_id=dataset_id,
                    length=length,
                    unit_size=unit_size,
                )
        return answer

    def lease(
        self,
        worker_id: str,
        dataset_id: str,
        count: int,
        next_epoch: bool = False,
        lease_key: str | None = None,
    ) -> dict:
        """Hand out work units; each belongs to `worker_id` until completed or released."""
        with self.state.transaction():
            answer = self.pool.lease(
                worker_id, dataset_id, count, time.time(), next_epoch, lease_key
            )
        faults.crash_point("leased")
        return answer

    def leases_of(self, worker_id: str, dataset_id: str) -> dict:
        """The units of a dataset leased to a worker, each with the samples still to train:
        what a worker resuming from its own checkpoint reconciles its position with."""
        return {"dataset_id": dataset_id, "units": self.pool.lease_bodies(worker_id, dataset_id)}

    def progress(self) -> list[dict]:
        return self.pool.progress()

    def check_reported(
        self, worker_id: str, units: Sequence[int], progress: Mapping[int, int]
    ) -> None:
        """422 unless every unit reported (finished or in part) is the worker's, and every
        partial count fits its unit (reads only)."""
        self.pool.check_reported(worker_id, units)
        if progress:
            self.pool.check_progress(worker_id, dict(progress))

    def still_leased(
        self, worker_id: str, units: Sequence[int], progress: Mapping[int, int]
    ) -> tuple[list[int], dict[int, int]]:
        """Of a late submission's reports, those the worker still holds (a unit the committed
        round already completed, a lost answer's retry, is not counted twice)."""
        finished = self.pool.leased_to(worker_id, list(units)) if units else []
        held = set(self.pool.leased_to(worker_id, list(progress))) if progress else set()
        return finished, {unit: n for unit, n in progress.items() if unit in held}
