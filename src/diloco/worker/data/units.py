"""The work units a worker reports with its pseudo-gradients (server-dispatched data).

A unit counts as trained only when the round that carries it commits, so the units a data
source has finished travel with the next submission, and the unit under way goes as a
prefix (`ID:COUNT`). Without a server-dispatched source there is nothing to report.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from diloco.wire.validation import MAX_UNITS_PER_SUBMISSION

log = logging.getLogger("diloco.worker")


class ReportsUnits(Protocol):
    """A data source of server-leased work units
    (diloco.worker.data.leased_sampler.LeasedSampler)."""

    def finished_units(self) -> list[int]: ...

    def reported(self, units: list[int]) -> None: ...

    def forget(self, units: list[int]) -> None: ...


class UnitReports:
    """What of `source` (None: a loop with its own data) goes with the next submission."""

    def __init__(self, source: ReportsUnits | None = None) -> None:
        self.source = source

    def finished(self) -> list[int]:
        """Every unit finished and not yet reported."""
        return [] if self.source is None else list(self.source.finished_units())

    def to_report(self) -> list[int]:
        """Units finished since the last submission, at most what one submission may carry;
        the rest stay finished and go with the next."""
        if self.source is None:
            return []
        return self.source.finished_units()[:MAX_UNITS_PER_SUBMISSION]

    def progress(self) -> dict[int, int]:
        """The unit under way and the samples of it trained (a source that tracks them)."""
        return self._ask("progress", {})

    def reported(self, units: list[int]) -> None:
        """`units` went with a submission the server took: the source drops them."""
        if self.source is not None:
            self.source.reported(units)

    def forget(self, units: list[int]) -> None:
        """`units` are no longer ours (an eviction gave our leases to others)."""
        if self.source is not None:
            self.source.forget(units)

    def take_lost_training(self) -> bool:
        """Whether the source trained samples of units that are no longer ours (an eviction
        gave them back to the pool) since the last call (see LeasedSampler's)."""
        return bool(self._ask("take_lost_training", False))

    def evicted(self) -> None:
        """The server evicted us: the source lets its leases go (LeasedSampler's)."""
        self._ask("evicted")

    def keep_lost_training(self) -> None:
        """The drop `take_lost_training` asked for did not happen: ask again next time."""
        self._ask("keep_lost_training")

    def round_dropped(self) -> None:
        """The round's pseudo-gradient was dropped: the source trains its units again from
        where the server has them (LeasedSampler's, which asks the server for our leases: if
        it cannot, the units stay as they are, reported later as trained though their
        samples are in no model, with a warning, rather than the round's result lost too)."""
        try:
            self._ask("round_dropped")
        except Exception as exc:
            log.warning(
                "could not ask the server for our work units after a dropped round (%s): the "
                "units finished in it will be reported as trained",
                exc,
            )

    def round_started(self) -> None:
        """A round begins: a source that keeps its position at round starts takes it."""
        self._ask("round_started")

    def drain_trace(self) -> list[tuple[int, int]] | None:
        """The samples handed out since the last call, from a traced source; else None."""
        return self._ask("drain_trace")

    def state(self) -> dict[str, Any] | None:
        """The source's position, for the worker's checkpoint (None if it has none)."""
        return self._ask("state_dict")

    def _ask(self, method: str, default: Any = None) -> Any:
        """`source.method()` where the source has it (LeasedSampler does), else `default`."""
        call = getattr(self.source, method, None)
        return call() if callable(call) else default
