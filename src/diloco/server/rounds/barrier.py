"""Sync and streaming DiLoCo on the server: a barrier per round of each fragment.

Sync mode is the case of one fragment holding every tensor. In streaming mode fragment f has
its own round counter, barrier set, running mean and cached result; its outer step touches only
its own tensors and their momentum, so the fragments sync on staggered schedules without
waiting for each other. Each fragment round's barrier set is taken when that round opens
(the live workers then, plus those registering before its first submission), so a worker that
joins late takes part from the next round of each fragment.

Sharded servers (sync) run the same engine with another role (`RoundsRole`,
server/shards/sync_decisions.py): every slice is held until shard 0 decides the round. One
server's role, `OneServer`, changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from diloco.server.errors import Rejection
from diloco.server.model.results import OnDemand, Published, RoundResult, Waiting
from diloco.server.rounds.engine import EngineContext
from diloco.server.rounds.robust import (
    Contributors,
    DecidedScales,
    Screening,
    ScreeningPart,
    decide_round,
    drop_held,
    screened_record,
)
from diloco.server.rounds.round import Round, Submission, ValueScan, fold
from diloco.server.state.journal import CommitRecord
from diloco.wire.format.spool import CheckedPieces


class RoundsRole(Protocol):
    """Where a shard's rounds differ from one server's: shard 0's (`SyncLeader`) and the
    other shards' (`SyncFollower`) hold every slice until the round is decided."""

    holds_slices: bool  # scanned, then held: nothing is folded before the decision
    follows: bool  # rounds wait for shard 0's decisions, not members; evicts nobody

    def new_round(self, number: int, members: set[str], weighting: str, now: float) -> Round:
        """A fragment's next round (with its barrier set: the live workers)."""
        ...

    def admits_replacement(self, current: Round, submission: Submission) -> bool:
        """Whether the open round takes a slice that replaces another process's (admit)."""
        ...

    def take(self, current: Round, submission: Submission) -> None:
        """Before the round holds an admitted slice (holds_slices)."""
        ...

    def decide(self, current: Round, now: float) -> bool:
        """Fold what a complete round holds as decided; False: decide as one server does."""
        ...

    def sessions_of(self, current: Round) -> dict[str, str]:
        """Each contributor's session digest, for the step's record."""
        ...

    def drop(self, current: Round, worker_id: str) -> None:
        """An admin banned the worker: it is in no decision."""
        ...

    def require_slice(self, current: Round, fragment: int, worker_id: str | None) -> None:
        """A follower's result poll of its open round: 409 while a decided slice is lost."""
        ...

    def holds(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> tuple[int, str] | None: ...

    def bound_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> float: ...

    def confirm(
        self, current: Round, worker_id: str, round_number: int, bound: float, squares: float
    ) -> None:
        """Shard 0: the worker's slices are on every shard; it counts for the barrier."""
        ...

    def take_decision(
        self,
        current: Round,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """A follower: shard 0's decision of the open round; whether it is news."""
        ...

    def screened(self, current: Round, now: float) -> bool:
        """Whether a complete round may be decided (robust aggregation on shards: shard 0
        first gathers every shard's part of its screening)."""
        ...

    def screening(self, current: Round) -> Screening | None:
        """Shard 0: the open round's screening while it waits for the other shards' parts."""
        ...

    def take_part(self, current: Round, shard: int, part: ScreeningPart) -> bool:
        """Shard 0: another shard's part of the open round's screening."""
        ...

    def screening_part(self, current: Round, kept: Mapping[str, str]) -> ScreeningPart | None:
        """A follower: its part of shard 0's screening of the `kept` slices."""
        ...

    def squares_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> float | None: ...


class OneServer:
    """One server's rounds (and a streaming shard's, which commits its own fragments): each
    submission folds as it comes (held only under robust aggregation), nothing is decided
    elsewhere."""

    holds_slices = False
    follows = False

    def new_round(self, number: int, members: set[str], weighting: str, now: float) -> Round:
        return Round(number, members, weighting, now)

    def admits_replacement(self, current: Round, submission: Submission) -> bool:
        return False

    def take(self, current: Round, submission: Submission) -> None:
        raise AssertionError("one server holds no slices")

    def decide(self, current: Round, now: float) -> bool:
        return False

    def sessions_of(self, current: Round) -> dict[str, str]:
        return {}

    def drop(self, current: Round, worker_id: str) -> None:
        pass

    def require_slice(self, current: Round, fragment: int, worker_id: str | None) -> None:
        raise AssertionError("one server decides its rounds")

    def holds(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> tuple[int, str] | None:
        return None

    def bound_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> float:
        return 0.0

    def confirm(
        self, current: Round, worker_id: str, round_number: int, bound: float, squares: float
    ) -> None:
        raise AssertionError("one server decides its rounds")

    def take_decision(
        self,
        current: Round,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        raise AssertionError("one server decides its rounds")

    def screened(self, current: Round, now: float) -> bool:
        return True

    def screening(self, current: Round) -> Screening | None:
        raise AssertionError("one server screens its rounds alone")

    def take_part(self, current: Round, shard: int, part: ScreeningPart) -> bool:
        raise AssertionError("one server screens its rounds alone")

    def screening_part(self, current: Round, kept: Mapping[str, str]) -> ScreeningPart | None:
        raise AssertionError("one server screens its rounds alone")

    def squares_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> float | None:
        return None


class BarrierRounds:
    """The open round of every fragment, and the result each one last committed."""

    def __init__(self, context: EngineContext, role: RoundsRole) -> None:
        self.c = context
        self.role = role  # one server's, or a shard's: held slices, decisions
        self.rounds: list[Round] = []  # empty until the global weights exist
        self.results: list[Published | None] = []
        self._fragment_rounds: list[int] = [0] * context.settings.fragments

    # ----------------------------------------------------------------- the engine interface

    def start(self, fragment_rounds: Sequence[int], now: float) -> None:
        """Open the current round of every fragment (the weights exist now, or were restored)."""
        settings = self.c.settings
        if len(fragment_rounds) != settings.fragments:
            raise ValueError(
                f"the state holds {len(fragment_rounds)} fragment round(s), the server has "
                f"{settings.fragments} fragment(s)"
            )
        self._fragment_rounds = [int(r) for r in fragment_rounds]
        live = self.c.membership.live_ids()
        self.rounds = [self._new_round(r, set(live), now) for r in self._fragment_rounds]
        self.results = [None] * settings.fragments

    def fragment_rounds(self) -> list[int]:
        return list(self._fragment_rounds)

    def fragment_rounds_after(self, record: CommitRecord) -> list[int]:
        rounds = list(self._fragment_rounds)
        rounds[record.fragment] += 1
        return rounds

    def open_round(self) -> Round | None:
        return self.rounds[0] if self.rounds else None

    def _owned(self) -> list[Round]:
        """The rounds of this server's fragments (a streaming shard's plan leaves the other
        shards' fragments empty: their rounds here never see a submission)."""
        plan = self.c.model.plan
        if plan is None or len(plan) != len(self.rounds):
            return list(self.rounds)
        return [current for current, names in zip(self.rounds, plan, strict=True) if names]

    def waiting_for(self) -> list[str]:
        return sorted({w for current in self._owned() for w in current.waiting_for()})

    def more_submissions_needed(self) -> int:
        minimum = self.c.settings.min_workers
        return max(
            (current.more_submissions_needed(minimum) for current in self._owned()), default=0
        )

    def on_register(self, worker_id: str) -> None:
        if self.role.follows:
            return  # membership is shard 0's: a follower's rounds wait for its decisions
        for current in self.rounds:
            if current.first_submission_at is None:
                # Nobody waits on this round yet, so the newcomer can join its barrier now.
                current.members.add(worker_id)

    def on_leave(self, worker_id: str, now: float) -> None:
        for current in self.rounds:
            current.leave(worker_id)
        for fragment in range(len(self.rounds)):
            self.complete_round(fragment, now)

    def units_of(self, worker_id: str) -> set[int]:
        return {unit for current in self.rounds for unit in current.units_of(worker_id)}

    def tick(self, now: float) -> None:
        """Barriers move on submissions and departures; a tick only retries a complete round
        whose decision failed on a read (robust aggregation: see screening.decide_round)."""
        if self.c.screen.on:
            for fragment, current in enumerate(self.rounds):
                if current.held:
                    self.complete_round(fragment, now)

    def overdue(self, now: float) -> list[str]:
        if self.role.follows:
            return []  # shard 0 evicts; a follower never does
        timeout = self.c.settings.effective_barrier_timeout
        assert timeout is not None
        if self.c.paused():
            return []  # the barrier's clock stops while an admin holds the rounds
        late: set[str] = set()
        for current in self._owned():
            if current.barrier_expired(now, timeout):
                late.update(current.waiting_for())
        return sorted(late)

    def wake_within(self, now: float) -> float:
        return 1.0

    def drop_pending(self, worker_id: str, reason: str) -> bool:
        for current in self.rounds:
            self.role.drop(current, worker_id)
        dropped = [drop_held(current, worker_id, reason) for current in self.rounds]
        return any(dropped)

    def on_resume(self, paused_since: float, now: float) -> None:
        """The barriers' clocks skip the pause (a first submission made during it counts from
        now); rounds that filled up meanwhile commit now."""
        for current in self.rounds:
            current.opened_at += max(0.0, now - max(current.opened_at, paused_since))
            first = current.first_submission_at
            if first is not None:
                current.first_submission_at = first + max(0.0, now - max(first, paused_since))
        for fragment in range(len(self.rounds)):
            self.complete_round(fragment, now)

    # ----------------------------------------------------------------- submissions

    def admit(self, submission: Submission) -> dict | None:
        c = self.c
        round_number, fragment = submission.round, submission.fragment
        current = self.rounds[fragment]
        if round_number == current.number and self.role.admits_replacement(current, submission):
            c.check_units(submission)
            return None
        if round_number > current.number:
            raise Rejection(
                409,
                "future_round",
                f"round {round_number}{self._of(fragment)} has not started; the current round "
                f"is {current.number}",
                current_round=current.number,
                fragment=fragment,
            )
        if round_number < current.number:
            # Its pseudo-gradient comes too late to be used, but the units it reports were
            # trained: they go with the open round, and complete when it commits (a unit the
            # committed round already completed, a lost answer's retry, is not counted twice).
            c.check_units(submission)
            self._carry_reports(current, submission)
            submission.record.last_seen = c.clock()
            # "duplicate" when the committed round used this pseudo-gradient (a retry whose
            # first send was folded before a crash ate the answer): the worker then keeps the
            # error-feedback residual it coded the body with, as the server folded that body
            used = c.applied_version(submission.worker_id, round_number, fragment) is not None
            return self._answer("duplicate" if used else "committed", round_number, fragment)
        if current.has(submission.worker_id, fragment):
            # A retry, or another body of a round that holds this worker's (a resend after a
            # sync that failed once the server had the first): not used, but the units it
            # reports were trained and the worker counts them as reported, so those it still
            # holds go with the round, as a late submission's do (else a unit finished since
            # the first body stayed leased to the worker, never completed).
            self._carry_reports(current, submission)
            submission.record.last_seen = c.clock()
            return self._answer("duplicate", round_number, fragment)
        c.check_units(submission)
        return None

    def _carry_reports(self, current: Round, submission: Submission) -> None:
        """A body the round does not fold (late, or a duplicate): the units it reports that
        the worker still holds go with `current` and complete when it commits (a unit a
        committed round already completed, a lost answer's retry, is not counted twice)."""
        worker_id = submission.worker_id
        finished, partial = self.c.data_leases.still_leased(
            worker_id, submission.units, submission.progress
        )
        if finished:
            current.add_units(worker_id, finished)
        if partial:
            current.add_progress(worker_id, partial)

    def folds_first(self, fragment: int) -> bool:
        """A round's first submission may be checked while it is folded, unless the round
        holds its submissions (robust aggregation: every one is scanned for its norm; a
        shard: every slice, until the round is decided)."""
        if self.role.holds_slices:
            return False
        return not self.c.screen.on and self.rounds[fragment].running is None

    def accept(self, submission: Submission, checked: CheckedPieces | ValueScan) -> dict:
        """2. fold (see `complete_round`): an admitted submission into its round, which may
        then be complete."""
        c = self.c
        now = c.clock()
        current = self.rounds[submission.fragment]
        if self.role.holds_slices:
            assert isinstance(checked, ValueScan)
            self.role.take(current, submission)
            current.hold(submission, checked, now)  # folded as the round's decision says
        elif c.screen.on:
            assert isinstance(checked, ValueScan) and checked.norm is not None
            current.hold(submission, checked, now)  # folded when the round decides
        else:
            folding = time.perf_counter()
            fold(current, submission, checked, self._sums(submission.fragment), now)
            c.metrics.round_part_seconds.labels(part="fold").observe(time.perf_counter() - folding)
        c.record_folded(submission, current, now)
        self.complete_round(submission.fragment, now)
        return self._answer("accepted", submission.round, submission.fragment)

    def _sums(self, fragment: int) -> dict[str, torch.Tensor]:
        """Where a fold that opens the fragment's sums writes them: the whole model's buffers
        with one fragment; with several, a pool the fragments' rounds share, or new buffers
        while another fragment's round has sums open (nothing when this round's are open
        already: the fold only adds to them)."""
        c = self.c
        if len(self.rounds) == 1:
            return c.model.sums_storage()
        if self.rounds[fragment].running is not None:
            return {}
        assert c.model.plan is not None
        others_open = any(
            other.running is not None for at, other in enumerate(self.rounds) if at != fragment
        )
        return c.model.fragment_sums_storage(c.model.plan[fragment], fresh=others_open)

    def _of(self, fragment: int) -> str:
        return f" of fragment {fragment}" if len(self.rounds) > 1 else ""

    def _answer(self, status: str, round_number: int, fragment: int) -> dict:
        """`waiting_for` is about the submitted round: empty once it has committed."""
        current = self.rounds[fragment]
        return {
            "status": status,
            "round": round_number,
            "fragment": fragment,
            "current_round": current.number,
            "waiting_for": current.waiting_for() if current.number == round_number else [],
        }

    def complete_round(self, fragment: int, now: float) -> None:
        """The life of a sync round (streaming: fragment `fragment`'s round), in order (lock
        held; docs/architecture.md, "Life of a round"). Steps 1-2 happen per submission:

        1. admit   `Intake.submit` -> `admit` below: member, round, fragment, units, layout
        2. fold    `accept` below: into the round's running mean as each body comes (held
                   unfolded under robust aggregation, and on a shard until shard 0 decides)
        3. decide  here: the barrier is met; a held round is folded as its decision says
        4. step    `EngineContext.commit` -> `GlobalModel.commit`: the outer optimizer
        5. persist the same call: the journal makes the step durable before it counts
        6. publish here: the result coded once, the next round opened, long-polls woken

        Called after every submission, departure, resume and (a shard) decision: it returns
        at once while the barrier waits.
        """
        c = self.c
        current = self.rounds[fragment]
        # 3. decide: every member has submitted or left, on a server that may step
        if (
            c.model.masters is None
            or c.model.broken is not None
            or c.paused()
            or not current.ready(c.settings.min_workers)
            or not self.role.screened(current, now)
        ):
            return  # (a broken server commits nothing until restarted; a paused one, resumed)
        started = time.perf_counter()
        self._decide(fragment, current, now)
        assert current.running is not None and c.model.plan is not None
        running = current.running  # stays the round's until the step is durable
        record = CommitRecord(
            round=c.model.version,
            contributors=sorted(current.submitters),
            units=current.all_units(),
            progress=current.all_progress(),
            released=current.progress_of_departed(c.membership.is_live),
            tokens=current.tokens,
            seconds=time.perf_counter() - started,
            fragment=fragment,
            fragment_round=current.number if len(self.rounds) > 1 else None,
            submissions=[(w, current.number, 0) for w in sorted(current.submitters)],
            sessions=self.role.sessions_of(current),
            **screened_record(c.screen, fragment, current),
        )
        # 4-5. step and persist: the outer step on the masters, durable before it counts
        c.commit(running, record, self.fragment_rounds_after(record), current.inputs)
        c.screen.restore(record.norm_history or ())  # what the step made durable
        current.running = None  # used up by the step
        # 6. publish: the fragment's result, then the next round with today's live workers
        what = f"round {current.number}{self._of(fragment)}"
        try:
            self._fragment_rounds[fragment] = current.number + 1
            self.results[fragment] = None  # free the old body before encoding the new one
            self.results[fragment] = self._encode_result(fragment, current.number + 1)
            self.rounds[fragment] = self._new_round(
                current.number + 1, set(c.membership.live_ids()), now
            )
        except Exception as exc:
            # The step is durable but its result or next round is not in place (out of
            # memory encoding it): serving on would answer future_round and wait for ever;
            # a restart serves the durable step.
            why = f"publishing {what} after its durable step failed: {exc!r}"
            raise c.model.stop_serving(why, exc_info=True) from None
        for when in current.submitted.values():
            c.metrics.barrier_wait_seconds.observe(max(0.0, now - when))
        c.publish(
            f"{what}: {len(current.submitted)} contribution(s) from "
            f"{', '.join(sorted(current.submitters))}",
            started,
        )

    def _new_round(self, number: int, members: set[str], now: float) -> Round:
        """A fragment's next round (sharded servers open their own kind)."""
        opened = self.role.new_round(number, members, self.c.settings.weighting, now)
        if self.c.settings.aggregation == "sparse_mean":
            opened.count_senders = True
            opened.senders_storage = self.c.model.senders_storage()  # the same every round
        return opened

    def _decide(self, fragment: int, current: Round, now: float) -> None:
        """Fold what a complete round held into its sums (robust aggregation holds every
        submission until here; a plain mean folded each one as it came; a shard folds the
        slices its round's decision names)."""
        c = self.c
        if self.role.decide(current, now):
            return
        if c.screen.on:
            assert c.model.plan is not None and c.model.specs is not None
            specs = {name: c.model.specs[name] for name in c.model.plan[fragment]}
            decide_round(c.screen, current, fragment, self._sums(fragment), specs, now)

    # ----------------------------------------------------------------- results

    def poll_result(
        self, round_number: int, fragment: int, worker_id: str | None, now: float
    ) -> RoundResult | None:
        """The result of (round, fragment) if it exists; raises for what cannot be waited on."""
        c = self.c
        if self.role.follows and self.rounds and round_number == self.rounds[0].number:
            self.role.require_slice(self.rounds[0], fragment, worker_id)
            return None  # once the decision is applied; no barrier timeout here: shard 0's
        if not self.rounds or round_number > self.rounds[fragment].number:
            current = self.rounds[fragment].number if self.rounds else 0
            raise Rejection(
                409,
                "future_round",
                f"round {round_number}{self._of(fragment)} has not started; the current round "
                f"is {current}",
                current_round=current,
                fragment=fragment,
            )
        current = self.rounds[fragment]
        if round_number < current.number:
            result = self.results[fragment]
            if result is None and round_number + 1 == current.number:
                # After a restart: the current weights are exactly that result.
                result = self._encode_result(fragment, current.number)
                self.results[fragment] = result
            if result is None or result.round != round_number + 1:
                raise Rejection(
                    410,
                    "result_expired",
                    f"the result of round {round_number}{self._of(fragment)} is no longer "
                    "kept; fetch /v1/weights",
                    current_round=current.number,
                    fragment=fragment,
                )
            return result.lend()
        if round_number == current.number and self.role.holds_slices:
            self.role.require_slice(current, fragment, worker_id)  # shard 0: a lost slice
            if self.role.screening(current) is not None:
                return None  # every member is in: shard 0 waits for the shards' sums, no timeout
        timeout = c.settings.effective_barrier_timeout
        assert timeout is not None
        if not c.paused() and current.barrier_expired(now, timeout):
            raise Rejection(
                504,
                "barrier_timeout",
                f"round {round_number}{self._of(fragment)} has waited more than {timeout:g} s "
                f"for {current.waiting_for()}",
                waiting_for=current.waiting_for(),
                round=round_number,
                fragment=fragment,
            )
        if (
            worker_id is not None
            and worker_id in current.members
            and not current.has(worker_id, fragment)
            and not c.closing()
        ):
            raise Rejection(
                409,
                "not_submitted",
                f"round {round_number}{self._of(fragment)} holds no submission from "
                f"{worker_id!r} (the server restarted since, or it was never sent); submit it "
                "again",
                round=round_number,
                fragment=fragment,
                worker_id=worker_id,
            )
        return None

    def _encode_result(self, fragment: int, next_round: int) -> Published:
        """What the workers of the fragment's round get: the current weights when one
        fragment is the whole model (encoded once per version), else a copy of its tensors."""
        c = self.c
        assert c.model.plan is not None
        if len(self.rounds) == 1:
            return c.model.current_weights(self.fragment_rounds())
        names = c.model.plan[fragment]
        delta = c.model.fragment_delta(c.model.version, names)
        return Published(
            next_round,
            # with a delta, most workers never download the fragment whole
            c.model.encode(names) if delta is None else OnDemand(lambda: c.model.encode(names)),
            fragment=fragment,
            delta=delta,
        )

    def waiting(self, round_number: int, fragment: int) -> Waiting:
        current = self.rounds[fragment]
        short = current.more_submissions_needed(self.c.settings.min_workers)
        return Waiting(round_number, current.waiting_for(), short)

    # ----------------------------------------------------------------- sharded servers (sync)

    def open_number(self) -> int | None:
        return self.rounds[0].number if self.rounds else None

    def holds(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> tuple[int, str] | None:
        """(tokens, session digest) of the worker's held slice of the open round, or None."""
        return self.role.holds(self.open_round(), worker_id, round_number, digest)

    def bound_of(self, worker_id: str, round_number: int, digest: str | None = None) -> float:
        """The bound of the values of the slice `holds` names (0 when none is held)."""
        return self.role.bound_of(self.open_round(), worker_id, round_number, digest)

    def squares_of(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> float | None:
        """Robust aggregation: the sum of squares of the slice `holds` names (None: none)."""
        return self.role.squares_of(self.open_round(), worker_id, round_number, digest)

    def confirm(
        self, worker_id: str, round_number: int, bound: float = 0.0, squares: float = 0.0
    ) -> dict:
        """Shard 0: the worker's slices of the open round are on every shard (checked by the
        caller), bounded by `bound` (robust aggregation: their squares on the other shards
        summing to `squares`): it counts for the barrier, which may now be met."""
        self.role.confirm(self.rounds[0], worker_id, round_number, bound, squares)
        self.complete_round(0, self.c.clock())
        return self._answer("accepted", round_number, 0)

    def apply_decision(
        self,
        round_number: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """A follower: shard 0 decided `round_number` with these contributors (worker -> the
        round they sent for, and the session digest of the slices it used) and (robust
        aggregation) how it used each: commit it once every decided slice is here. False if
        it is not the open round (already applied, or not reached)."""
        current = self.open_round()
        if current is None or current.number != round_number:
            return False
        if self.role.take_decision(current, decided, screened):
            self.complete_round(0, self.c.clock())
        return True

    def screening(self, round_number: int) -> Screening | None:
        """Shard 0: round `round_number`'s screening while it waits for the other shards'
        parts (None: it is not the open round, or waits for none)."""
        current = self.open_round()
        if current is None or current.number != round_number:
            return None
        return self.role.screening(current)

    def take_part(self, round_number: int, shard: int, part: ScreeningPart) -> bool:
        """Shard 0: another shard's part of the open round's screening, which may then be
        decided; whether it is news. 409 `screening_changed` when that round is not the
        one screening those slices."""
        current = self.open_round()
        if current is None or current.number != round_number:
            raise Rejection(
                409,
                "screening_changed",
                f"round {round_number} is not the open round ("
                + ("none yet: no weights" if current is None else f"round {current.number}")
                + ")",
                round=round_number,
                current_round=None if current is None else current.number,
            )
        taken = self.role.take_part(current, shard, part)
        self.complete_round(0, self.c.clock())
        return taken

    def screening_part(self, round_number: int, kept: Mapping[str, str]) -> ScreeningPart | None:
        """A follower: its part of shard 0's screening of the open round's `kept` slices
        (None: not the open round, or a kept slice is not here yet)."""
        current = self.open_round()
        if current is None or current.number != round_number:
            return None
        return self.role.screening_part(current, kept)

    def pending_anchor(self, worker_id: str) -> int | None:
        raise AssertionError("sync rounds have no arrivals (async)")

    def weights_at(self, version: int) -> RoundResult:
        raise AssertionError("sync shards serve no exact versions (async)")

    def poll_version(
        self, round_number: int, worker_id: str | None, version: int, now: float
    ) -> RoundResult | None:
        raise AssertionError("sync shards serve no exact versions (async)")
