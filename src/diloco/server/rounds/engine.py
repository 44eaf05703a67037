"""The interface of a round engine: when the coordinator combines pseudo-gradients into an
outer step (`BarrierRounds` for sync and streaming, `AsyncArrivals` for async; built by
`engines.engine_for`), and `EngineContext`, the narrow view of the run an engine is given.
The coordinator calls every method under its lock. Only the types live here, so a module that
holds an engine imports no engine. `ShardEngine` adds what sharded servers' cross-shard commit
(server/shards/commit.py) asks of either engine. The engines receive the context, never the
coordinator: what they touch is listed there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from diloco.algorithm import RunningMean
from diloco.server.members.membership import Membership
from diloco.server.model.global_model import GlobalModel
from diloco.server.model.results import RoundResult, Waiting
from diloco.server.ops.metrics import ServerMetrics
from diloco.server.rounds.robust import (
    Contributors,
    DecidedScales,
    RobustScreen,
    Screening,
    ScreeningPart,
)
from diloco.server.rounds.round import Round, Submission, ValueScan
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import CommitRecord
from diloco.server.state.step_inputs import InputCopy
from diloco.server.workunits.leases import DataLeases
from diloco.wire.format.spool import CheckedPieces


class AppliedVersion(Protocol):
    """StateStore.applied_version: the outer step that used (worker, round it was sent for
    (async: its anchor version), fragment)'s pseudo-gradient, or None."""

    def __call__(self, worker_id: str, round_number: int, fragment: int = 0) -> int | None: ...


@dataclass(frozen=True)
class EngineContext:
    """The run as an engine sees it. Every call happens under the coordinator's lock."""

    settings: ServerSettings
    clock: Callable[[], float]
    model: GlobalModel  # masters, plan, version, encodings; read, and stepped via `commit`
    membership: Membership  # who is live (read only)
    metrics: ServerMetrics
    data_leases: DataLeases  # whether reported units are the worker's
    applied_version: AppliedVersion  # the step that used a worker's pseudo-gradient, if any
    record_folded: Callable[[Submission, Round, float], None]  # a folded submission's bookkeeping
    # step, make durable; last: the round's bodies in the state dir, in fold order (or None)
    commit: Callable[[RunningMean, CommitRecord, Sequence[int], list[InputCopy] | None], None]
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
        self.data_leases.check_reported(submission.worker_id, submission.units, submission.progress)


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


class ShardEngine(RoundEngine, Protocol):
    """A round engine's part in sharded servers: held slices, shard 0's confirmations, a
    follower's decisions, and (async) exact versions. Both engines are one; their role
    (one server, shard 0, another shard) answers, or asserts it is never asked."""

    def open_number(self) -> int | None:
        """The round this shard has open (async: the version the next step makes from)."""
        ...

    def holds(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> tuple[int, str] | None:
        """(tokens, session digest) of the worker's held slice of `round_number`, or None."""
        ...

    def bound_of(self, worker_id: str, round_number: int, digest: str | None = None) -> float:
        """The bound of the values of the slice `holds` names (0 when none is held)."""
        ...

    def squares_of(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> float | None:
        """Robust aggregation (sync): the sum of squares of the slice `holds` names."""
        ...

    def confirm(
        self, worker_id: str, round_number: int, bound: float = 0.0, squares: float = 0.0
    ) -> dict:
        """Shard 0: the worker's slice is on every shard; it counts for the round (window)."""
        ...

    def pending_anchor(self, worker_id: str) -> int | None:
        """Async: the anchor of the worker's confirmed arrival in the open window, if any."""
        ...

    def apply_decision(
        self,
        round_number: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """A follower: shard 0's decision of `round_number`; False if it is not the open one."""
        ...

    def screening(self, round_number: int) -> Screening | None:
        """Shard 0 (sync, robust aggregation): the open round's screening while it waits for
        the other shards' parts."""
        ...

    def take_part(self, round_number: int, shard: int, part: ScreeningPart) -> bool:
        """Shard 0 (sync): another shard's part of the open round's screening."""
        ...

    def screening_part(self, round_number: int, kept: Mapping[str, str]) -> ScreeningPart | None:
        """A follower (sync): its part of shard 0's screening of the `kept` slices."""
        ...

    def weights_at(self, version: int) -> RoundResult:
        """Async: the weights of exactly `version`."""
        ...

    def poll_version(
        self, round_number: int, worker_id: str | None, version: int, now: float
    ) -> RoundResult | None:
        """Async: a result poll answered only with exactly `version`'s weights."""
        ...
