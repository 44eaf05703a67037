"""The interface of a round engine: when the coordinator combines pseudo-gradients into an
outer step (`BarrierRounds` for sync and streaming, `AsyncArrivals` for async; built by
`engines.engine_for`). The coordinator calls every method under its lock. Only the type lives
here, so a module that holds an engine imports nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from diloco.server.model.results import RoundResult, Waiting
from diloco.server.rounds.round import Round, ValueScan
from diloco.server.rounds.submission import Submission
from diloco.server.state.journal import CommitRecord
from diloco.wire.format.spool import CheckedPieces


class RoundEngine(Protocol):
    def start(self, fragment_rounds: Sequence[int], now: float) -> None:
        """The global weights exist (or were restored at these fragment rounds): open rounds."""

    def fragment_rounds(self) -> list[int]: ...

    def fragment_rounds_after(self, record: CommitRecord) -> list[int]:
        """The fragment rounds once `record`'s step has committed (for its checkpoint)."""
        ...

    def open_round(self) -> Round | None: ...

    def waiting_for(self) -> list[str]: ...

    def more_submissions_needed(self) -> int:
        """Submissions an open round needs beyond its members' (--min-workers): from joiners."""
        ...

    def on_register(self, worker_id: str) -> None: ...

    def on_leave(self, worker_id: str, now: float) -> None: ...

    def units_of(self, worker_id: str) -> set[int]:
        """Work units a worker reported with a submission that is still pending."""
        ...

    def tick(self, now: float) -> None: ...

    def overdue(self, now: float) -> list[str]:
        """Live members a barrier has waited on past its timeout (their heartbeats may go on
        while their training loop hangs): the coordinator evicts them."""
        ...

    def wake_within(self, now: float) -> float:
        """How long a long-poll may sleep before something may be due."""
        ...

    def drop_pending(self, worker_id: str, reason: str) -> bool:
        """Discard a worker's pseudo-gradients not yet applied, where the engine still can
        (rounds that hold theirs until the barrier); whether any was dropped."""
        ...

    def on_resume(self, paused_since: float, now: float) -> None:
        """An admin resumed rounds paused since `paused_since`: commit what is ready."""
        ...

    def admit(self, submission: Submission) -> dict | None:
        """Decide what a submission is, before its values are read: an answer when there is
        nothing to fold (already applied, a duplicate), None to fold it; raises Rejection."""
        ...

    def folds_first(self, fragment: int) -> bool:
        """Whether the next fold opens its step's sums (so a reader that checks the values as
        it folds them can refuse half way and leave nothing changed)."""
        ...

    def accept(self, submission: Submission, checked: CheckedPieces | ValueScan) -> dict:
        """Fold an admitted submission and commit a step if one is due; WireError from a
        checking reader leaves everything as it was."""
        ...

    def poll_result(
        self, round_number: int, fragment: int, worker_id: str | None, now: float
    ) -> RoundResult | None: ...

    def waiting(self, round_number: int, fragment: int) -> Waiting: ...
