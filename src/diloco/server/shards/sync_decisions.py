"""Sync rounds across sharded servers: shard 0 decides each round, every shard applies it.

Each shard holds its slice of every submission (spooled, not yet folded) until the round is
decided. A worker confirms on shard 0 once every shard holds its slices; shard 0's barrier
waits for its members' confirmations, and the round's decision is the set of confirmed
workers. Shard 0 folds exactly their slices, in worker-id order, steps, and writes the
decision with the step (its `rounds` row, durable before any shard can read it). The other
shards fold exactly the decided slices, in the same order, when they learn the decision
(server/shards/peers.py); a slice of a worker left out is dropped, so a step is applied on
every shard with the same submissions or on none. docs/architecture.md has the proof sketch.

`SyncLeader` and `SyncFollower` are a `BarrierRounds`'s role (its `RoundsRole`): the engine
calls them where a shard's rounds differ from one server's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from diloco.algorithm import Contribution
from diloco.algorithm.contributions import FINITE_SUM_LIMIT, contribution_weight
from diloco.server.errors import Rejection
from diloco.server.rounds.engine import EngineContext
from diloco.server.rounds.robust import (
    Contributors,
    DecidedScales,
    Screening,
    ScreeningPart,
    fold_screened,
    opposed_sums,
)
from diloco.server.rounds.round import Round, Submission, ValueScan, fold
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec
from diloco.wire.format.spool import PieceBody


def session_digest(session: str | None) -> str:
    """A short digest of a registration session: equal for slices of one process."""
    return hashlib.sha256((session or "").encode()).hexdigest()[:16]


@dataclass
class LeaderRound(Round):
    """Shard 0's round: a member is in once it confirmed that every shard holds its slices."""

    confirmed: set[str] = field(default_factory=set)
    loads: dict[str, float] = field(default_factory=dict)  # worker -> weight x value bound
    # robust aggregation: worker -> the sum of squares of its whole pseudo-gradient (every
    # shard's slice), and the round's screening once every member confirmed
    squares: dict[str, float] = field(default_factory=dict)
    screening: Screening | None = None

    def waiting_for(self) -> list[str]:
        return sorted(self.members - self.confirmed)

    def ready(self, min_workers: int) -> bool:
        return not self.waiting_for() and len(self.confirmed) >= max(1, min_workers)


@dataclass
class FollowerRound(Round):
    """Another shard's round: it commits when shard 0's decision names who is in."""

    decided: list[str] | None = None
    decided_sessions: dict[str, str] = field(default_factory=dict)  # worker -> digest
    # robust aggregation: the slices shard 0 screens (worker -> digest) while it asks for
    # this shard's part, then how its decision used each
    screening: dict[str, str] | None = None
    screened: DecidedScales | None = None

    def waiting_for(self) -> list[str]:
        if self.decided is None:
            return sorted(set(self.screening or ()) - self.submitters)
        return sorted(set(self.decided) - self.submitters)

    def ready(self, min_workers: int) -> bool:
        return self.decided is not None and not self.waiting_for()


def checked_load(
    worker_id: str,
    tokens: int,
    scale: float,
    bound: float,
    others: Iterable[float],
    settings: ServerSettings,
) -> float:
    """What a confirmed slice adds to the bound of its step's sums on any shard (its weight
    x scale x the largest value any shard holds of it); 422 `sum_overflow` (nothing
    changed) when, added to `others`, some shard's fp32 sums could overflow: refused by shard
    0, where every shard's bound is known, not when each shard folds. A hair under the limit
    each fold checks (RunningMean.headroom), so no fold can refuse what shard 0 took."""
    weight = contribution_weight(Contribution({}, tokens), settings.weighting)
    load = abs(weight * scale) * bound
    if sum(others) + load > FINITE_SUM_LIMIT * (1 - 1e-6):
        raise Rejection(
            422,
            "sum_overflow",
            f"{worker_id!r}'s pseudo-gradient holds values up to {bound:.3g}: added to "
            "its step, some shard's fp32 sums could overflow",
            bound=bound,
            limit=FINITE_SUM_LIMIT,
        )
    return load


def _release(submission: Submission) -> None:
    if isinstance(submission.tensors, PieceBody):
        submission.tensors.release()


HeldPairs = Sequence[tuple[Submission, ValueScan]]


def _fold_only(
    current: Round,
    chosen: set[str],
    storage: dict,
    now: float,
    fold_chosen: Callable[[HeldPairs], None] | None = None,
) -> None:
    """Fold the held slices of `chosen` in worker-id order (with `fold_chosen`: as a robust
    rule's verdict says); every other submission leaves the round (its place, units and
    progress too: it is not part of this step), so the round's submitters, which its record
    names as the decision, are exactly what was held of `chosen`: a slice an admin's ban
    dropped from `held` is not among them. Bodies are released."""
    held = sorted(current.held, key=lambda pair: pair[0].worker_id)
    mine = [pair for pair in held if pair[0].worker_id in chosen]
    if fold_chosen is not None:
        fold_chosen(mine)
    else:
        for submission, scan in mine:
            fold(current, submission, scan, storage, now, record=False)
    folded = {submission.worker_id for submission, _ in mine}
    for worker_id, fragment in list(current.submitted):
        if worker_id not in folded:
            del current.submitted[(worker_id, fragment)]
            current.units.pop(worker_id, None)
            current.progress.pop(worker_id, None)
    current.held = []
    for submission, _ in held:
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.release()
    if current.running is None:  # nobody chosen: the step changes nothing
        current.open_sums(storage)


class HeldRounds:
    """Every slice is held until the round's decision (what shard 0 and the others share):
    the session each held slice came from, and the slices a newer process's replaced."""

    holds_slices = True  # scanned, then held: nothing is folded before the decision
    follows = False

    def __init__(self, context: EngineContext) -> None:
        self.c = context
        # (round, worker) -> the registration session its held slice came from
        self._sessions: dict[tuple[int, str], str | None] = {}
        # a follower: slices a newer process's slice replaced, by (round, worker, digest),
        # kept until the round is decided (shard 0 may have confirmed the older one)
        self._replaced: dict[tuple[int, str, str], tuple[Submission, ValueScan, str | None]] = {}

    def new_round(self, number: int, members: set[str], weighting: str, now: float) -> Round:
        raise NotImplementedError

    def sessions_of(self, current: Round) -> dict[str, str]:
        return {
            w: session_digest(self._sessions.get((current.number, w))) for w in current.submitters
        }

    def take(self, current: Round, submission: Submission) -> None:
        """Before the round holds an admitted slice: it replaces another process's (admit
        let it through for this), and its session is noted."""
        self._replace_other_session(current, submission)
        # the session as it is now: a re-registration changes the record's in place
        self._sessions[(current.number, submission.worker_id)] = submission.record.session
        for key in [k for k in self._sessions if k[0] < current.number]:
            del self._sessions[key]
        for key in [k for k in self._replaced if k[0] < current.number]:
            _release(self._replaced.pop(key)[0])

    def holds(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None = None
    ) -> tuple[int, str] | None:
        """(tokens, session digest) of `worker_id`'s held slice of the open round
        `round_number` (from the process of `digest`, when given), or None. The digest tells
        slices of two processes under one id apart (a worker restarted without its
        checkpoint) without showing the session."""
        if current is None or current.number != round_number:
            return None
        for submission, _ in current.held:
            if submission.worker_id == worker_id:
                session = self._sessions.get((round_number, worker_id))
                if digest is None or session_digest(session) == digest:
                    return submission.tokens, session_digest(session)
        replaced = self._replaced.get((round_number, worker_id, digest or ""))
        if replaced is not None:
            return replaced[0].tokens, session_digest(replaced[2])
        return None

    def admits_replacement(self, current: Round, submission: Submission) -> bool:
        """A slice from a new session of a worker whose older session's slice this round
        still holds, undecided, will replace it (the old process is gone), so that every
        shard ends up with the same process's slices: in `take`, once its body passed its
        checks (a refused body changes nothing)."""
        self._check_decided_session(current, submission)
        return self._other_session_held(current, submission) and self._replaceable(
            current, submission.worker_id
        )

    def _check_decided_session(self, current: Round, submission: Submission) -> None:
        """A follower whose round is decided takes only the decided process's slice."""

    def _other_session_held(self, current: Round, submission: Submission) -> bool:
        key = (current.number, submission.worker_id)
        return (
            any(held.worker_id == submission.worker_id for held, _ in current.held)
            and self._sessions.get(key) != submission.record.session
        )

    def _replace_other_session(self, current: Round, submission: Submission) -> None:
        key = (current.number, submission.worker_id)
        if not self._other_session_held(current, submission):
            return
        old_session = self._sessions.get(key)
        for held, scan in [p for p in current.held if p[0].worker_id == submission.worker_id]:
            current.held.remove((held, scan))
            current.submitted.pop((held.worker_id, held.fragment), None)
            self._set_aside(current.number, held, scan, old_session)

    def _set_aside(
        self, number: int, held: Submission, scan: ValueScan, session: str | None
    ) -> None:
        """A slice a newer process's replaced: gone (shard 0, which never confirmed it)."""
        _release(held)

    def bound_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None = None
    ) -> float:
        """The bound of the values of the slice `holds` names (0 when none is held)."""
        pair = self._slice(current, worker_id, round_number, digest)
        return 0.0 if pair is None else pair[1].bound

    def _replaceable(self, current: Round, worker_id: str) -> bool:
        return True

    def drop(self, current: Round, worker_id: str) -> None:
        """An admin banned the worker (its held slice is dropped by the engine)."""

    def decide(self, current: Round, now: float) -> bool:
        """Fold the decided slices of a complete round (in worker-id order)."""
        raise NotImplementedError

    def confirm(
        self, current: Round, worker_id: str, round_number: int, bound: float, squares: float
    ) -> None:
        raise Rejection(409, "not_shard_0", "confirmations go to shard 0, which decides the rounds")

    def take_decision(
        self,
        current: Round,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        raise Rejection(409, "not_shard_0", "shard 0 makes the decisions")

    def screened(self, current: Round, now: float) -> bool:
        """Whether a complete round may be decided (shard 0 may first ask the others)."""
        return True

    def screening(self, current: Round) -> Screening | None:
        raise Rejection(409, "not_shard_0", "shard 0 screens the rounds")

    def take_part(self, current: Round, shard: int, part: ScreeningPart) -> bool:
        raise Rejection(409, "not_shard_0", "shard 0 screens the rounds")

    def screening_part(self, current: Round, kept: Mapping[str, str]) -> ScreeningPart | None:
        raise Rejection(409, "not_applicable", "shard 0 screens its own slices")

    def squares_of(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None = None
    ) -> float | None:
        """Robust aggregation: the sum of squares of the trained values of the slice `holds`
        names (None when none is held, or nothing is screened)."""
        pair = self._slice(current, worker_id, round_number, digest)
        if pair is None or not self.c.screen.on:
            return None
        return float(pair[1].norm or 0.0) ** 2

    def _slice(
        self, current: Round | None, worker_id: str, round_number: int, digest: str | None
    ) -> tuple[Submission, ValueScan] | None:
        """The held slice `holds` names (or one a newer process's replaced, by digest)."""
        if current is None or current.number != round_number:
            return None
        session = self._sessions.get((round_number, worker_id))
        for submission, scan in current.held:
            if submission.worker_id == worker_id and (
                digest is None or session_digest(session) == digest
            ):
                return submission, scan
        replaced = self._replaced.get((round_number, worker_id, digest or ""))
        return None if replaced is None else (replaced[0], replaced[1])

    def _specs(self) -> dict[str, TensorSpec]:
        """This shard's tensors (a sync shard's plan is one fragment: every tensor it owns)."""
        c = self.c
        assert c.model.plan is not None and c.model.specs is not None
        return {name: c.model.specs[name] for name in c.model.plan[0]}

    def _fold_screened(
        self,
        current: Round,
        norms: Mapping[str, float],
        scales: Mapping[str, float],
        refused: Mapping[str, str],
        now: float,
    ) -> Callable[[HeldPairs], None]:
        """What folds the chosen held slices as a robust rule's verdict (by worker) says."""

        def fold_chosen(held: HeldPairs) -> None:
            workers = [submission.worker_id for submission, _ in held]
            fold_screened(
                self.c.screen,
                current,
                held,
                [norms.get(w, 0.0) for w in workers],
                [scales.get(w, 1.0) for w in workers],
                {i: refused[w] for i, w in enumerate(workers) if w in refused},
                self.c.model.sums_storage(),
                self._specs(),
                now,
            )

        return fold_chosen

    def require_slice(self, current: Round, fragment: int, worker_id: str | None) -> None:
        raise NotImplementedError


class SyncLeader(HeldRounds):
    """Shard 0: membership, confirmations, and each round's decision."""

    def new_round(self, number: int, members: set[str], weighting: str, now: float) -> Round:
        return LeaderRound(number, members, weighting, now)

    def _replaceable(self, current: Round, worker_id: str) -> bool:
        assert isinstance(current, LeaderRound)
        return worker_id not in current.confirmed  # confirmed: every shard holds that slice

    def confirm(
        self, current: Round, worker_id: str, round_number: int, bound: float, squares: float
    ) -> None:
        """`worker_id`'s slices of the open round are held on every shard (checked by the
        caller), their values bounded by `bound` on all of them and (robust aggregation)
        their squares summing to `squares` on the other shards: it counts for the barrier,
        and the round may now be decided (the engine commits it). 422 `sum_overflow`
        (nothing changed) when, added to the round, it could overflow some shard's fp32
        sums: refused here, where every shard's bound is known, not when each shard folds."""
        assert isinstance(current, LeaderRound)
        tokens = self.holds(current, worker_id, round_number)
        others = [v for w, v in current.loads.items() if w != worker_id]
        load = checked_load(
            worker_id, 0 if tokens is None else tokens[0], 1.0, bound, others, self.c.settings
        )
        current.loads[worker_id] = load
        current.confirmed.add(worker_id)
        mine = self.squares_of(current, worker_id, round_number)
        if mine is not None:
            current.squares[worker_id] = mine + squares
        if current.screening is not None:  # every shard holds its slice again: none lacks it
            for lacking in current.screening.missing.values():
                lacking.discard(worker_id)

    def screened(self, current: Round, now: float) -> bool:
        """Robust aggregation: the complete round's screening (made once for its confirmed
        slices, again if they change: a ban) is complete once every other shard sent its part
        of the opposed check, asked for on the decisions route (`screening`)."""
        if not self.c.screen.on:
            return True
        assert isinstance(current, LeaderRound)
        slices = tuple(
            (w, session_digest(self._sessions.get((current.number, w))))
            for w in sorted(current.confirmed)
        )
        if current.screening is None or current.screening.slices != slices:
            current.screening = self._screen(current, slices)
        return current.screening.complete(len(self.c.settings.shard_urls))

    def _screen(self, current: LeaderRound, slices: tuple[tuple[str, str], ...]) -> Screening:
        """The norms' verdict, and shard 0's part of the opposed check over its own slices."""
        norms = [math.sqrt(current.squares.get(w, 0.0)) for w, _ in slices]
        verdict = self.c.screen.verdict(0, norms)
        refused = dict(verdict.refused)
        kept = [index not in refused for index in range(len(slices))]
        chosen = {w for w, _ in slices}
        held = [p for p in sorted(current.held, key=lambda p: p[0].worker_id)
                if p[0].worker_id in chosen]  # fmt: skip
        # one held slice per confirmed worker (a confirmed one is never replaced; a ban
        # takes it out of both): rows pair by position
        assert [p[0].worker_id for p in held] == [w for w, _ in slices]
        check = opposed_sums(held, kept, self._specs())
        return Screening(
            slices, norms, list(verdict.scales), refused, check, {self.c.settings.shard}
        )

    def screening(self, current: Round) -> Screening | None:
        """The open round's screening while it waits for the other shards' parts."""
        assert isinstance(current, LeaderRound)
        screening = current.screening
        shards = len(self.c.settings.shard_urls)
        if screening is None or screening.complete(shards) or not self.c.screen.on:
            return None
        return screening

    def take_part(self, current: Round, shard: int, part: ScreeningPart) -> bool:
        """Another shard's part of the open round's opposed check; whether it is news."""
        screening = self.screening(current)
        if screening is None:
            raise Rejection(
                409,
                "screening_changed",
                f"round {current.number} is not waiting for a part of its screening",
                round=current.number,
            )
        return screening.take_part(shard, part)

    def require_slice(self, current: Round, fragment: int, worker_id: str | None) -> None:
        """A result poll of the open round while it is screened: a kept worker whose slice
        another shard lacks (lost in a restart) is told to send it again (its worker sends
        every slice and confirms again; shards that hold one answer `duplicate`)."""
        assert isinstance(current, LeaderRound)
        screening = current.screening
        lacking = [] if screening is None or worker_id is None else screening.lacking(worker_id)
        if lacking and not self.c.closing():
            raise Rejection(
                409,
                "not_submitted",
                f"round {current.number} is being screened with {worker_id!r}, whose slice "
                f"shard(s) {', '.join(map(str, lacking))} do not hold (restarted since); "
                "submit it again",
                round=current.number,
                fragment=fragment,
                worker_id=worker_id,
                shards=lacking,
            )

    def drop(self, current: Round, worker_id: str) -> None:
        """An admin banned the worker: its held slice is not part of any decision."""
        if isinstance(current, LeaderRound):
            current.confirmed.discard(worker_id)
            current.loads.pop(worker_id, None)

    def decide(self, current: Round, now: float) -> bool:
        assert isinstance(current, LeaderRound)
        folds = None
        screening = current.screening
        if self.c.screen.on and screening is not None:
            workers = [w for w, _ in screening.slices]
            refused = {workers[i]: reason for i, reason in screening.verdict().items()}
            norms = dict(zip(workers, screening.norms, strict=True))
            scales = dict(zip(workers, screening.scales, strict=True))
            folds = self._fold_screened(current, norms, scales, refused, now)
        _fold_only(current, current.confirmed, self.c.model.sums_storage(), now, folds)
        return True


class SyncFollower(HeldRounds):
    """Shards 1..S-1: hold slices; commit a round when shard 0's decision arrives. Membership
    is shard 0's: a follower's rounds wait for decisions, not members, and it evicts nobody."""

    follows = True

    def new_round(self, number: int, members: set[str], weighting: str, now: float) -> Round:
        return FollowerRound(number, set(), weighting, now)

    def _replaceable(self, current: Round, worker_id: str) -> bool:
        assert isinstance(current, FollowerRound)
        return current.decided is None

    def _set_aside(
        self, number: int, held: Submission, scan: ValueScan, session: str | None
    ) -> None:
        """Kept until the round is decided: shard 0 may have confirmed the older process's
        slice (its decision names the session digest it used)."""
        self._replaced[(number, held.worker_id, session_digest(session))] = (held, scan, session)

    def take_decision(
        self,
        current: Round,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """Shard 0 decided the open round with these contributors (worker -> the round they
        sent for, this one, and the session digest of the slices it used) and (robust
        aggregation) how it used each; whether this is news (the engine commits it once
        every decided slice is here: now, or when the missing ones are sent again)."""
        assert isinstance(current, FollowerRound)
        if current.decided is not None:
            return False
        current.screened = screened
        for worker_id, (_, digest) in decided.items():
            if digest is not None:
                self._take_back(current, worker_id, digest)
                current.decided_sessions[worker_id] = digest
        current.decided = sorted(decided)
        return True

    def _check_decided_session(self, current: Round, submission: Submission) -> None:
        """Round decided with another process's slice of this worker (one this shard lost
        in a restart): a newer process's cannot stand in for it."""
        assert isinstance(current, FollowerRound)
        decided = current.decided_sessions.get(submission.worker_id)
        if decided is not None and decided != session_digest(submission.record.session):
            raise Rejection(
                409,
                "not_decided",
                f"round {current.number} was decided with another process's slice of "
                f"{submission.worker_id!r}; this one cannot take its place",
                round=current.number,
                worker_id=submission.worker_id,
            )

    def _take_back(self, current: FollowerRound, worker_id: str, digest: str) -> None:
        """The decided slice is one a newer process's replaced: it goes back in the round
        (the newer one is set aside), so this shard folds what shard 0 folded."""
        key = (current.number, worker_id)
        if session_digest(self._sessions.get(key)) == digest:
            return
        older = self._replaced.pop((current.number, worker_id, digest), None)
        for held, scan in [p for p in current.held if p[0].worker_id == worker_id]:
            current.held.remove((held, scan))
            current.submitted.pop((held.worker_id, held.fragment), None)
            self._set_aside(current.number, held, scan, self._sessions.get(key))
        if older is not None:
            submission, scan, session = older
            current.held.append((submission, scan))
            current.submitted[(worker_id, submission.fragment)] = self.c.clock()
            self._sessions[key] = session

    def decide(self, current: Round, now: float) -> bool:
        assert isinstance(current, FollowerRound) and current.decided is not None
        folds = None
        screened = current.screened
        if self.c.screen.on and screened is not None:
            folds = self._fold_screened(
                current, screened.norms, screened.scales, screened.refused(), now
            )
        _fold_only(current, set(current.decided), self.c.model.sums_storage(), now, folds)
        return True

    def screening_part(self, current: Round, kept: Mapping[str, str]) -> ScreeningPart | None:
        """This shard's part of shard 0's opposed check over the `kept` slices (worker ->
        session digest), summed over its tensors in worker-id order; while some of them are
        not here (lost in a restart), a part that names them, so that shard 0 tells their
        workers to send them again."""
        assert isinstance(current, FollowerRound)
        current.screening = dict(kept)
        order = sorted(kept)
        held = [self._slice(current, w, current.number, kept[w]) for w in order]
        missing = tuple(w for w, pair in zip(order, held, strict=True) if pair is None)
        if missing:  # shard 0 tells their workers to send them again
            return ScreeningPart(dict(kept), {}, {}, 0.0, missing)
        check = opposed_sums(held, [True] * len(held), self._specs())  # type: ignore[arg-type]
        return ScreeningPart(
            dict(kept),
            dict(zip(order, check.dots, strict=True)),
            dict(zip(order, check.squares, strict=True)),
            check.median_squares,
        )

    def require_slice(self, current: Round, fragment: int, worker_id: str | None) -> None:
        """A result poll of the open round: a decided worker whose slice this shard lacks
        (lost in a restart) is told to send it again. No barrier timeout: shard 0's."""
        assert isinstance(current, FollowerRound)
        missing = worker_id is not None and worker_id in current.waiting_for()
        if missing and not self.c.closing():
            how = "was decided" if current.decided is not None else "is being screened"
            raise Rejection(
                409,
                "not_submitted",
                f"round {current.number} {how} with {worker_id!r}, whose slice this "
                "shard does not hold (it restarted since); submit it again",
                round=current.number,
                fragment=fragment,
                worker_id=worker_id,
            )
