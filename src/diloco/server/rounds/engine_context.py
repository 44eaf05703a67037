"""What a round engine may read and do: the narrow view of the run it decides steps for.

The engines (`BarrierRounds`, `AsyncArrivals`) receive this, never the coordinator: what they
touch is listed here and nowhere else, and no import cycle runs through the coordinator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diloco.algorithm import RunningMean
from diloco.server.members.membership import Membership
from diloco.server.model.global_model import GlobalModel
from diloco.server.ops.metrics import ServerMetrics
from diloco.server.rounds.robust import RobustScreen
from diloco.server.rounds.round import Round
from diloco.server.rounds.submission import Submission
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import CommitRecord
from diloco.server.workunits.transactions import DataDispatch


@dataclass(frozen=True)
class EngineContext:
    """The run as an engine sees it. Every call happens under the coordinator's lock."""

    settings: ServerSettings
    clock: Callable[[], float]
    model: GlobalModel  # masters, plan, version, encodings; read, and stepped via `commit`
    membership: Membership  # who is live (read only)
    metrics: ServerMetrics
    dispatch: DataDispatch  # whether reported units are the worker's
    applied_version: Callable[[str, int], int | None]  # async: (worker, anchor) -> its step
    book: Callable[[Submission, Round, float], None]  # a folded submission's bookkeeping
    commit: Callable[[RunningMean, CommitRecord, Sequence[int]], None]  # step, make durable
    publish: Callable[[str, float], None]  # after a step's result is out: log, wake polls
    closing: Callable[[], bool]  # the server is shutting down
    paused: Callable[[], bool]  # an admin paused rounds: submissions fold in, nothing commits
    screen: RobustScreen  # robust aggregation: norms, clipping, refusals (off under "mean")

    def stopped(self) -> bool:
        """No step may commit: shutting down, paused by an admin, or broken by a failed write
        until restarted."""
        return self.closing() or self.paused() or self.model.broken is not None

    def check_units(self, submission: Submission) -> None:
        """422 unless every unit the submission reports is the worker's (reads only)."""
        self.dispatch.check_reported(submission.worker_id, submission.units, submission.progress)
