"""Asynchronous DiLoCo on the server: every pseudo-gradient is applied when it arrives.

There is no barrier. The outer optimizer is Delayed Nesterov (Liu et al. 2024, Algorithm 3).
With a grace window of S seconds, arrivals within S seconds of the first pending one are
averaged into one outer step; the deadline does not slide, and the window closes early once
every live worker has arrived. A submission is keyed by (worker, the version its anchor was):
the `submissions` table of the state store says whether and by which step it was applied, so
a retry, even across a restart, is never applied twice. Staleness (outer steps between the
worker's anchor and now) is recorded per submission and may scale the pseudo-gradient by
(1 + staleness)^-1/2.

Sharded servers (async) run the same engine with another role (`ArrivalsRole`,
server/shards/async_decisions.py): every slice is held until shard 0 decides the step. One
server's role, `OneServerArrivals`, changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from diloco.algorithm import GraceWindow, staleness_scale
from diloco.server.errors import Rejection
from diloco.server.model.results import RoundResult, Waiting
from diloco.server.rounds.engine import EngineContext
from diloco.server.rounds.robust import (
    Contributors,
    DecidedScales,
    Screening,
    ScreeningPart,
    screened_record,
)
from diloco.server.rounds.round import Round, Submission, ValueScan, fold
from diloco.server.state.journal import CommitRecord
from diloco.wire.format.spool import CheckedPieces

log = logging.getLogger("diloco.server")


class ArrivalsRole(Protocol):
    """Where a shard's arrivals differ from one server's: shard 0's (`AsyncLeader`) and the
    other shards' (`AsyncFollower`) hold every slice until a step's decision folds it. A
    method that needs the grace window (`window`, `anchors`) is handed the engine."""

    holds_slices: bool  # scanned, then held: nothing is folded before its step
    follows: bool  # steps wait for shard 0's decisions, not members or a window of arrivals

    def start(self, engine: AsyncArrivals) -> None:
        """The weights exist (or were restored): the engine's window is empty."""
        ...

    def already_holds(self, submission: Submission) -> bool:
        """Whether the submission's slice is held already (admit: a "duplicate")."""
        ...

    def take(self, submission: Submission, checked: CheckedPieces | ValueScan) -> None:
        """Hold an admitted slice (holds_slices)."""
        ...

    def before_commit(self, engine: AsyncArrivals, now: float) -> bool:
        """Before the engine tries to commit its window: whether it may (a follower builds
        the window from shard 0's decision here)."""
        ...

    def after_commit(self, engine: AsyncArrivals) -> None:
        """After the engine tried to commit its window (`engine.window` is None once the step
        is made)."""
        ...

    def fold_held(self, engine: AsyncArrivals, window: Round, now: float) -> None:
        """Before the step: fold what the window holds unfolded."""
        ...

    def sessions_of(self, window: Round) -> dict[str, str]:
        """Each contributor's session digest, for the step's record."""
        ...

    def on_leave(self, worker_id: str) -> None:
        """The worker left (before its window place goes)."""
        ...

    def drop_pending(self, engine: AsyncArrivals, worker_id: str) -> bool:
        """An admin banned the worker: whether any of its arrivals was dropped."""
        ...

    def waiting_for(self) -> list[str]:
        """A follower: the workers whose decided slices are missing here."""
        ...

    def poll_result(
        self, engine: AsyncArrivals, round_number: int, worker_id: str | None
    ) -> RoundResult | None:
        """A follower's result poll."""
        ...

    def holds(
        self, worker_id: str, round_number: int, digest: str | None
    ) -> tuple[int, str] | None: ...

    def bound_of(self, worker_id: str, round_number: int, digest: str | None) -> float: ...

    def squares_of(self, worker_id: str, round_number: int, digest: str | None) -> float | None:
        """Robust aggregation: the sum of squares of the slice `holds` names."""
        ...

    def confirm(
        self,
        engine: AsyncArrivals,
        worker_id: str,
        round_number: int,
        bound: float,
        now: float,
        squares: float = 0.0,
    ) -> int:
        """Shard 0: the held slice is on every shard; it joins the window. Its staleness."""
        ...

    def take_decision(
        self,
        version: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """A follower: shard 0's decision of the next version; whether it is news."""
        ...

    def weights_at(self, engine: AsyncArrivals, version: int) -> RoundResult:
        """The weights of exactly `version`: the current ones, or one this shard kept."""
        ...


class OneServerArrivals:
    """One server's arrivals: each one folds into the grace window as it comes, nothing is
    decided elsewhere."""

    holds_slices = False
    follows = False

    def start(self, engine: AsyncArrivals) -> None:
        pass

    def already_holds(self, submission: Submission) -> bool:
        return False

    def take(self, submission: Submission, checked: CheckedPieces | ValueScan) -> None:
        raise AssertionError("one server holds no slices")

    def before_commit(self, engine: AsyncArrivals, now: float) -> bool:
        return True

    def after_commit(self, engine: AsyncArrivals) -> None:
        pass

    def fold_held(self, engine: AsyncArrivals, window: Round, now: float) -> None:
        pass  # every arrival was folded when it came

    def sessions_of(self, window: Round) -> dict[str, str]:
        return {}

    def on_leave(self, worker_id: str) -> None:
        pass

    def drop_pending(self, engine: AsyncArrivals, worker_id: str) -> bool:
        return False  # an arrival is folded into its window when it arrives

    def waiting_for(self) -> list[str]:
        raise AssertionError("one server decides its steps")

    def poll_result(
        self, engine: AsyncArrivals, round_number: int, worker_id: str | None
    ) -> RoundResult | None:
        raise AssertionError("one server decides its steps")

    def holds(
        self, worker_id: str, round_number: int, digest: str | None
    ) -> tuple[int, str] | None:
        return None

    def bound_of(self, worker_id: str, round_number: int, digest: str | None) -> float:
        return 0.0

    def squares_of(self, worker_id: str, round_number: int, digest: str | None) -> float | None:
        return None

    def confirm(
        self,
        engine: AsyncArrivals,
        worker_id: str,
        round_number: int,
        bound: float,
        now: float,
        squares: float = 0.0,
    ) -> int:
        raise AssertionError("one server decides its steps")

    def take_decision(
        self,
        version: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        raise AssertionError("one server decides its steps")

    def weights_at(self, engine: AsyncArrivals, version: int) -> RoundResult:
        raise AssertionError("one server serves no exact versions")


class AsyncArrivals:
    """The open grace window (when one is) and the keys of the arrivals it holds."""

    def __init__(self, context: EngineContext, role: ArrivalsRole) -> None:
        self.c = context
        self.role = role  # one server's, or a shard's: held slices, decisions
        self.grace = GraceWindow(context.settings.grace_seconds)  # the simulator's rule too
        self.window: Round | None = None
        self.anchors: dict[str, int] = {}  # worker -> the version its pending arrival was for

    # ----------------------------------------------------------------- the engine interface

    def start(self, fragment_rounds: Sequence[int], now: float) -> None:
        if len(fragment_rounds) != 1:
            raise ValueError(f"async mode has one fragment, the state holds {len(fragment_rounds)}")
        self.window = None
        self.anchors.clear()
        self.role.start(self)

    def fragment_rounds(self) -> list[int]:
        return [self.c.model.version]

    def fragment_rounds_after(self, record: CommitRecord) -> list[int]:
        return [record.round + 1]

    def open_round(self) -> Round | None:
        return self.window

    def waiting_for(self) -> list[str]:
        if self.role.follows:
            return self.role.waiting_for() if self.window is None else []
        return [] if self.window is None else self.window.waiting_for()

    def more_submissions_needed(self) -> int:
        return 0  # no quorum: an arrival never waits for workers to join

    def on_register(self, worker_id: str) -> None:
        if self.role.follows:
            return  # membership is shard 0's: a follower's steps wait for its decisions
        if self.window is not None:
            self.window.members.add(worker_id)  # the window closes early once it arrives too

    def on_leave(self, worker_id: str, now: float) -> None:
        if self.role.follows:
            return  # a slice shard 0 may have confirmed stays until a decision uses or passes it
        self.role.on_leave(worker_id)
        if self.window is not None:
            self.window.leave(worker_id)
        self.complete_window(now)

    def units_of(self, worker_id: str) -> set[int]:
        return set() if self.window is None else self.window.units_of(worker_id)

    def tick(self, now: float) -> None:
        self.complete_window(now)

    def overdue(self, now: float) -> list[str]:
        return []  # no barrier: a hung worker holds nobody up

    def drop_pending(self, worker_id: str, reason: str) -> bool:
        return self.role.drop_pending(self, worker_id)

    def on_resume(self, paused_since: float, now: float) -> None:
        """Arrivals held while paused went into one window: it is applied now, as one step."""
        self.complete_window(now)

    def wake_within(self, now: float) -> float:
        """A long-poll wakes by the window's deadline, which it may then close itself (not
        while paused: the resume wakes every poll)."""
        if self.window is None or self.window.first_submission_at is None or self.c.paused():
            return 1.0
        deadline = self.grace.deadline(self.window.first_submission_at)
        return max(0.001, min(1.0, deadline - now))

    # ----------------------------------------------------------------- submissions

    def _applied_answer(self, submission: Submission) -> dict | None:
        """409 for an anchor past the current version; "duplicate" for an arrival a step
        already applied (its key in the submissions table); None otherwise."""
        c = self.c
        worker_id, round_number = submission.worker_id, submission.round
        if round_number > c.model.version:
            raise self.future_round(round_number)
        applied = c.applied_version(worker_id, round_number)
        if applied is None:
            return None
        submission.record.last_seen = c.clock()
        return self._answer("duplicate", round_number, applied)

    def admit(self, submission: Submission) -> dict | None:
        c = self.c
        answer = self._applied_answer(submission)
        if answer is not None:
            return answer
        if not self.role.follows:  # (a follower's window is shard 0's decision)
            answer = self._pending(submission)
            if answer is not None:
                return answer
        if self.role.already_holds(submission):
            submission.record.last_seen = c.clock()
            return self._answer("duplicate", submission.round, None)
        return None  # (a follower: another process's slice of the same anchor stays)

    def _pending(self, submission: Submission) -> dict | None:
        """A "duplicate" for the arrival the window holds; 409 while another is pending."""
        c = self.c
        worker_id, round_number = submission.worker_id, submission.round
        pending = self.anchors.get(worker_id)
        if pending is not None:
            if pending == round_number:
                submission.record.last_seen = c.clock()
                return self._answer("duplicate", round_number, None)
            raise Rejection(
                409,
                "already_pending",
                f"worker {worker_id!r} already has an arrival pending (sent for version "
                f"{pending}); wait for its result before sending another",
                pending_round=pending,
            )
        c.check_units(submission)
        return None

    def folds_first(self, fragment: int) -> bool:
        """Never: opening a window on a refused arrival would leave an empty one open."""
        return False

    def accept(self, submission: Submission, checked: CheckedPieces | ValueScan) -> dict:
        """2. fold (see `complete_window`): an admitted arrival into the grace window, which
        may then close."""
        c = self.c
        if self.role.holds_slices:  # held until a decision (shard 0: until confirmed)
            self.role.take(submission, checked)
            if self.role.follows:
                self.complete_window(c.clock())
            return self._answer("accepted", submission.round, None)
        now = c.clock()
        worker_id, round_number = submission.worker_id, submission.round
        staleness = c.model.version - round_number
        window = self.window
        if window is None:
            window = Round(c.model.version, c.membership.live_ids(), c.settings.weighting, now)
        scale = staleness_scale(staleness, c.settings.staleness_weighting)
        refusal, clip = None, 1.0
        if c.screen.on:
            # Each arrival against the history and the window's own: decided now, not later.
            assert isinstance(checked, ValueScan) and checked.norm is not None
            verdict = c.screen.verdict(0, [*window.norms.values(), checked.norm])
            last = len(window.norms)
            refusal = verdict.refused.get(last)
            clip = verdict.scales[last]
        if refusal is not None:
            if window.running is None:
                window.open_sums(c.model.sums_storage())  # a step that changes nothing
            window.record_refused(submission, refusal, now)
            log.warning("%s's pseudo-gradient refused: %s", worker_id, refusal)
        else:
            folding = time.perf_counter()
            fold(window, submission, checked, c.model.sums_storage(), now, scale * clip)
            c.metrics.round_part_seconds.labels(part="fold").observe(time.perf_counter() - folding)
            if c.screen.on:  # only once folded: a refused fold (422) leaves no trace
                window.norms[worker_id] = float(checked.norm or 0.0)
                if clip < 1.0:
                    window.clipped[worker_id] = clip
        self.window = window
        self.anchors[worker_id] = round_number
        c.metrics.staleness.observe(staleness)
        c.record_folded(submission, window, now)
        self.complete_window(now)
        return self._answer(
            "accepted",
            round_number,
            # Applied by now unless the window is still open (it holds the arrival then).
            None if worker_id in self.anchors else c.model.version - 1,
            staleness,
        )

    def future_round(self, round_number: int) -> Rejection:
        """A worker ahead of the server: it restarted from an older checkpoint (a rebase)."""
        version = self.c.model.version
        return Rejection(
            409,
            "future_round",
            f"version {round_number} does not exist yet; the current version is {version}",
            current_round=version,
        )

    def _answer(
        self, status: str, round_number: int, applied: int | None, staleness: int | None = None
    ) -> dict:
        answer = {
            "status": status,
            "round": round_number,
            "fragment": 0,
            "current_round": self.c.model.version,
            "waiting_for": self.waiting_for() if applied is None else [],
            "applied_version": applied,
        }
        if staleness is not None:
            answer["staleness"] = staleness
        return answer

    def _ready(self, now: float) -> bool:
        window = self.window
        if window is None or window.first_submission_at is None:
            return False
        last = max(window.submitted.values())
        return self.grace.closed(window.first_submission_at, last, not window.waiting_for(), now)

    def complete_window(self, now: float) -> None:
        """The life of an async arrival, in order (lock held; docs/architecture.md, "Life of
        a round"). Steps 1-2 happen per arrival:

        1. admit   `Intake.submit` -> `admit` below: member, anchor version, units, layout,
                   and never one applied already (the submissions table)
        2. fold    `accept` below: into the grace window's running mean at once, scaled by
                   its staleness (robust aggregation: judged against the window's norms)
        3. decide  here: the grace window closes (its deadline passed, or every live worker
                   has arrived); a shard: shard 0's decision, once its slices are all here
        4. step    `EngineContext.commit` -> `GlobalModel.commit`: Delayed Nesterov
        5. persist the same call: the journal makes the step durable before it counts
        6. publish here: the new weights coded once for every worker, long-polls woken

        Called after every arrival, departure, tick and (a shard) decision: it returns at
        once while the window is open.
        """
        c = self.c
        # 3. decide (a follower builds the window from shard 0's decision here)
        if not self.role.before_commit(self, now):
            return
        window = self.window
        # (a broken server commits nothing until restarted)
        ready = c.model.masters is not None and not c.stopped() and self._ready(now)
        if window is not None and ready:
            started = time.perf_counter()
            self.role.fold_held(self, window, now)
            assert window.running is not None
            running = window.running  # stays the window's until the step is durable
            submitters = sorted(window.submitters)
            record = CommitRecord(
                round=c.model.version,
                contributors=submitters,
                units=window.all_units(),
                progress=window.all_progress(),
                released=window.progress_of_departed(c.membership.is_live),
                tokens=window.tokens,
                seconds=time.perf_counter() - started,
                # Staleness of each: the window opened at the current version, its anchor
                # before.
                submissions=[
                    (w, self.anchors[w], window.number - self.anchors[w]) for w in submitters
                ],
                sessions=self.role.sessions_of(window),
                **screened_record(c.screen, 0, window),
            )
            # 4-5. step and persist: the outer step on the masters, durable before it counts
            c.commit(running, record, self.fragment_rounds_after(record), None)
            c.screen.restore(record.norm_history or ())  # what the step made durable
            self.window = None
            self.anchors.clear()
            # 6. publish: coded once for every worker of this step
            c.model.current_weights(self.fragment_rounds())
            for when in window.submitted.values():
                c.metrics.barrier_wait_seconds.observe(max(0.0, now - when))
            c.publish(
                f"async step {record.round}: {len(submitters)} arrival(s) from "
                f"{', '.join(f'{w} (staleness {s})' for w, _, s in record.submissions)}",
                started,
            )
        self.role.after_commit(self)

    # ----------------------------------------------------------------- results

    def poll_result(
        self, round_number: int, fragment: int, worker_id: str | None, now: float
    ) -> RoundResult | None:
        """The weights after the step that applied (worker, round_number)'s pseudo-gradient.

        If other steps committed before the worker asked, it gets the newer weights (they hold
        its contribution too); `round` of the result says which version they are.
        """
        c = self.c
        if self.role.follows:
            return self.role.poll_result(self, round_number, worker_id)
        if worker_id is None:
            raise Rejection(
                422,
                "invalid_request",
                "field 'worker_id' is required in async mode: a result belongs to a worker's "
                "arrival",
                field="worker_id",
            )
        if self.anchors.get(worker_id) == round_number:
            self.complete_window(now)  # the deadline may have passed with nobody else to close it
            if self.anchors.get(worker_id) == round_number:
                return None
        if c.applied_version(worker_id, round_number) is not None:
            return c.model.current_weights(self.fragment_rounds()).lend()
        if round_number > c.model.version:
            raise self.future_round(round_number)
        if c.closing():
            return None
        raise Rejection(
            409,
            "not_submitted",
            f"no arrival of {worker_id!r} for version {round_number} is pending or applied "
            "(the server restarted since, or it was never sent); submit it again",
            round=round_number,
            worker_id=worker_id,
        )

    def waiting(self, round_number: int, fragment: int) -> Waiting:
        return Waiting(round_number, self.waiting_for())

    # ----------------------------------------------------------------- sharded servers (async)

    def open_number(self) -> int | None:
        """The version the next step makes from (None before the weights exist)."""
        return None if self.c.model.masters is None else self.c.model.version

    def pending_anchor(self, worker_id: str) -> int | None:
        """The anchor of the worker's confirmed arrival in the open window, if any."""
        return self.anchors.get(worker_id)

    def holds(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> tuple[int, str] | None:
        """(tokens, session digest) of the slice held for (worker, anchor) from the process
        of `digest` (any, when not given), or None."""
        return self.role.holds(worker_id, round_number, digest)

    def bound_of(self, worker_id: str, round_number: int, digest: str | None = None) -> float:
        """The bound of the values of the slice `holds` names (0 when none is held)."""
        return self.role.bound_of(worker_id, round_number, digest)

    def confirm(
        self, worker_id: str, round_number: int, bound: float = 0.0, squares: float = 0.0
    ) -> dict:
        """Shard 0: the held slice of (worker, anchor) is on every shard (checked by the
        caller), bounded by `bound` (robust aggregation: its squares on the other shards
        summing to `squares`): it joins the grace window, which may now close."""
        now = self.c.clock()
        staleness = self.role.confirm(self, worker_id, round_number, bound, now, squares)
        self.complete_window(now)
        applied = None if worker_id in self.anchors else self.c.model.version - 1
        return self._answer("accepted", round_number, applied, staleness)

    def apply_decision(
        self,
        version: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """A follower: shard 0 made `version` from these arrivals (worker -> anchor, session
        digest): apply it once every one of their slices is here. False if it is not the
        next version here; `screened`: how shard 0's robust rule used each (clipped_mean)."""
        if self.c.model.masters is None or version != self.c.model.version:
            return False
        if self.role.take_decision(version, decided, screened):
            self.complete_window(self.c.clock())
        return True

    def weights_at(self, version: int) -> RoundResult:
        """The weights of exactly `version`: the current ones, or one this shard kept."""
        return self.role.weights_at(self, version)

    def squares_of(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> float | None:
        """Robust aggregation: the sum of squares of the slice `holds` names (None: none)."""
        return self.role.squares_of(worker_id, round_number, digest)

    def screening(self, round_number: int) -> Screening | None:
        return None  # each arrival is screened at its confirmation, by its norm alone

    def take_part(self, round_number: int, shard: int, part: ScreeningPart) -> bool:
        raise Rejection(
            409,
            "screening_changed",
            "async shards screen each arrival by its norm alone: no parts are summed",
        )

    def screening_part(self, round_number: int, kept: Mapping[str, str]) -> ScreeningPart | None:
        return None

    def poll_version(
        self, round_number: int, worker_id: str | None, version: int, now: float
    ) -> RoundResult | None:
        """The result of (worker, round_number)'s arrival at exactly `version` (shard 0's,
        which the worker took first): None until this shard has applied the arrival and
        reached `version`."""
        if self.poll_result(round_number, 0, worker_id, now) is None:
            return None
        applied = self.c.applied_version(worker_id, round_number)
        if applied is not None and version <= applied:
            raise Rejection(
                422,
                "invalid_request",
                f"field 'version' ({version}) names weights from before the step that applied "
                f"this arrival (which made version {applied + 1})",
                field="version",
                got=version,
            )
        if version > self.c.model.version:
            return None
        return self.weights_at(version)
