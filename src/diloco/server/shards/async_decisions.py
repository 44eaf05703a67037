"""Async arrivals across sharded servers: shard 0 decides each step, every shard applies it.

Each shard holds its slice of an arrival, keyed by (worker, the version its anchor was),
spooled and not folded. The worker confirms on shard 0 once every shard holds its slices;
only then does the arrival join shard 0's grace window. When the window closes, shard 0 folds
its arrivals in worker-id order, each scaled by its staleness, steps (Delayed Nesterov), and
writes the step with its `rounds` and `submissions` rows: that is the decision of the version
(who, and the anchor of each), durable before any shard can read it. The other shards apply
the decisions in version order, folding the same slices in the same order with the same
scales, so the Delayed Nesterov counters and buffers of every shard move in step. A follower
keeps the last few versions it served, so a worker can take every shard's part of one version
while the versions move on (docs/architecture.md, "Sharded servers").

`AsyncLeader` and `AsyncFollower` are an `AsyncArrivals`'s role (its `ArrivalsRole`): the
engine calls them where a shard's arrivals differ from one server's, handing itself over where
they need its grace window.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from diloco.algorithm import staleness_scale
from diloco.server.errors import Rejection
from diloco.server.model.results import RoundResult
from diloco.server.rounds.async_arrivals import AsyncArrivals
from diloco.server.rounds.engine import EngineContext
from diloco.server.rounds.robust import Contributors, DecidedScales
from diloco.server.rounds.round import Round, Submission, ValueScan, fold
from diloco.server.shards.sync_decisions import checked_load, session_digest
from diloco.wire.format.spool import CheckedPieces, PieceBody

log = logging.getLogger("diloco.server")
KEPT_VERSIONS = 3  # a follower's versions before its current one, for a worker that took
# shard 0's first


@dataclass
class HeldSlice:
    """A slice waiting for its decision, with the registration session it came from."""

    submission: Submission
    scan: ValueScan
    session: str | None
    at: float  # when it arrived (a follower forgets one no decision named for long)

    @property
    def digest(self) -> str:
        return session_digest(self.session)


def _release(submission: Submission) -> None:
    if isinstance(submission.tensors, PieceBody):
        submission.tensors.release()


class HeldArrivals:
    """Slices held by (worker, anchor version, session digest) until a step folds them (both
    sides): two processes under one id never share a key, so a decision that names the
    digest it used picks the same slice on every shard."""

    holds_slices = True  # scanned, then held: nothing is folded before its step
    follows = False

    def __init__(self, context: EngineContext) -> None:
        self.c = context
        self.held: dict[tuple[str, int, str], HeldSlice] = {}
        self.kept: deque[RoundResult] = deque(maxlen=KEPT_VERSIONS + 1)  # and the current
        self.window_sessions: dict[str, str] = {}  # worker -> digest of the window's slice
        # robust aggregation (clipped_mean): worker -> its clip in the window (0: refused)
        self.window_clips: dict[str, float] = {}

    def start(self, engine: AsyncArrivals) -> None:
        pass

    def _of(self, worker_id: str, round_number: int) -> list[tuple[str, int, str]]:
        return [k for k in self.held if k[0] == worker_id and k[1] == round_number]

    def holds(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> tuple[int, str] | None:
        """(tokens, session digest) of the slice held for (worker, anchor) from the process
        of `digest` (any, when not given), or None."""
        held = self._latest(worker_id, round_number, digest)
        return None if held is None else (held.submission.tokens, held.digest)

    def _latest(self, worker_id: str, round_number: int, digest: str | None) -> HeldSlice | None:
        """The slice `holds` names: the latest held for (worker, anchor), of `digest`'s
        process when given."""
        keys = self._of(worker_id, round_number)
        if digest is not None:
            keys = [k for k in keys if k[2] == digest]
        return max((self.held[k] for k in keys), key=lambda h: h.at) if keys else None

    def bound_of(self, worker_id: str, round_number: int, digest: str | None = None) -> float:
        """The bound of the values of the slice `holds` names (0 when none is held)."""
        keys = self._of(worker_id, round_number)
        if digest is not None:
            keys = [k for k in keys if k[2] == digest]
        return max((self.held[k].scan.bound for k in keys), default=0.0)

    def squares_of(
        self, worker_id: str, round_number: int, digest: str | None = None
    ) -> float | None:
        """Robust aggregation: the sum of squares of the trained values of the slice
        `holds` names (None when none is held, or nothing is screened)."""
        held = self._latest(worker_id, round_number, digest)
        if held is None or not self.c.screen.on:
            return None
        return float(held.scan.norm or 0.0) ** 2

    def _key(self, submission: Submission) -> tuple[str, int, str]:
        return (
            submission.worker_id,
            submission.round,
            session_digest(submission.record.session),
        )

    def already_holds(self, submission: Submission) -> bool:
        return self._key(submission) in self.held

    def _hold(self, submission: Submission, checked: CheckedPieces | ValueScan) -> None:
        assert isinstance(checked, ValueScan)
        c = self.c
        now = c.clock()
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.hold()  # the request's close() then leaves the file open
        self.held[self._key(submission)] = HeldSlice(
            submission, checked, submission.record.session, now
        )
        # its worker's sign of life and bytes; units join the window at the confirmation
        c.record_folded(submission, Round(submission.round, set(), c.settings.weighting, now), now)

    def take(self, submission: Submission, checked: CheckedPieces | ValueScan) -> None:
        self._hold(submission, checked)

    def _drop(self, keys: list[tuple[str, int, str]]) -> bool:
        for key in keys:
            _release(self.held.pop(key).submission)
        return bool(keys)

    def before_commit(self, engine: AsyncArrivals, now: float) -> bool:
        return True

    def after_commit(self, engine: AsyncArrivals) -> None:
        pass

    def sessions_of(self, window: Round) -> dict[str, str]:
        return {w: d for w, d in self.window_sessions.items() if w in window.submitters}

    def fold_held(self, engine: AsyncArrivals, window: Round, now: float) -> None:
        """Fold the window's arrivals in worker-id order, each scaled by its staleness (and
        its clip under clipped_mean; a refused one not at all): the order and scales every
        shard uses, so their sums are the same function of the same slices."""
        storage = self.c.model.sums_storage()
        for submission, scan in sorted(window.held, key=lambda pair: pair[0].worker_id):
            anchor = engine.anchors[submission.worker_id]
            scale = staleness_scale(window.number - anchor, self.c.settings.staleness_weighting)
            clip = self.window_clips.get(submission.worker_id, 1.0)
            if clip > 0:
                fold(window, submission, scan, storage, now, scale * clip, record=False)
        for submission, _ in window.held:
            _release(submission)
        window.held = []
        if window.running is None:
            window.open_sums(storage)  # nobody left in it: a step that changes nothing

    def on_leave(self, worker_id: str) -> None:
        pass

    def drop_pending(self, engine: AsyncArrivals, worker_id: str) -> bool:
        return False

    def waiting_for(self) -> list[str]:
        raise NotImplementedError

    def poll_result(
        self, engine: AsyncArrivals, round_number: int, worker_id: str | None
    ) -> RoundResult | None:
        raise NotImplementedError

    def confirm(
        self,
        engine: AsyncArrivals,
        worker_id: str,
        round_number: int,
        bound: float,
        now: float,
        squares: float = 0.0,
    ) -> int:
        raise Rejection(409, "not_shard_0", "confirmations go to shard 0, which decides the rounds")

    def take_decision(
        self,
        version: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        raise Rejection(409, "not_shard_0", "shard 0 makes the decisions")

    def weights_at(self, engine: AsyncArrivals, version: int) -> RoundResult:
        """The weights of exactly `version`: the current ones, or one this shard kept."""
        c = self.c
        current = c.model.version
        if version == current:
            return c.model.current_weights(engine.fragment_rounds()).lend()
        for kept in self.kept:
            if kept.round == version:
                return kept
        if version > current:
            raise engine.future_round(version)
        raise Rejection(
            409,
            "version_gone",
            f"this shard no longer keeps version {version} (it is at {current} and keeps "
            f"the {KEPT_VERSIONS} before it); ask shard 0 for the current version again",
            version=version,
            current_round=current,
        )


class AsyncLeader(HeldArrivals):
    """Shard 0: membership, confirmations, the grace window, and each step's decision."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        # what each arrival in the window counted: tokens, and its value bound times its weight
        self.window_tokens: dict[str, int] = {}
        self.window_bounds: dict[str, float] = {}

    def take(self, submission: Submission, checked: CheckedPieces | ValueScan) -> None:
        """Held until confirmed. Its worker's other slices (another anchor, or an older
        process's) were never confirmed, so no decision names them: they go, now that this
        one passed its checks."""
        self._drop([k for k in self.held if k[0] == submission.worker_id])
        self._hold(submission, checked)

    def confirm(
        self,
        engine: AsyncArrivals,
        worker_id: str,
        round_number: int,
        bound: float,
        now: float,
        squares: float = 0.0,
    ) -> int:
        """The held slice of (worker, anchor) is on every shard (checked by the caller), its
        values bounded by `bound` on all of them: it joins the grace window (which the
        engine then tries to close); its staleness. 422 `sum_overflow` (nothing changed)
        when, added to the window, it could overflow some shard's fp32 sums: refused here,
        where every shard's bound is known, not when each shard folds. Under clipped_mean
        it is screened here, as one server screens an arrival, by its whole norm (its
        squares here and `squares`, the other shards'): refused or clipped."""
        c = self.c
        (key,) = self._of(worker_id, round_number)
        held = self.held[key]
        staleness = c.model.version - round_number
        scale = staleness_scale(staleness, c.settings.staleness_weighting)
        window = engine.window
        if window is None:
            window = Round(c.model.version, c.membership.live_ids(), c.settings.weighting, now)
        # screened first, as one server screens an arrival before it folds it: a refused one
        # adds nothing to the window's sums, a clipped one its clipped values
        norm = math.sqrt((held.scan.norm or 0.0) ** 2 + squares)
        refusal, clip = self._verdict(window, norm) if c.screen.on else (None, 1.0)
        load = 0.0
        if refusal is None:
            load = checked_load(
                worker_id,
                held.submission.tokens,
                scale * clip,
                bound,
                self.window_bounds.values(),
                c.settings,
            )
        del self.held[key]
        window.hold(held.submission, held.scan, now)
        self.window_tokens[worker_id] = max(0, held.submission.tokens)
        self.window_bounds[worker_id] = load
        self.window_sessions[worker_id] = held.digest
        window.add_units(worker_id, held.submission.units)
        if held.submission.progress:
            window.add_progress(worker_id, held.submission.progress)
        if c.screen.on:
            self.window_clips[worker_id] = 0.0 if refusal is not None else clip
            if refusal is not None:
                window.refused[worker_id] = refusal
                log.warning("%s's pseudo-gradient refused: %s", worker_id, refusal)
            else:
                window.norms[worker_id] = norm
                if clip < 1.0:
                    window.clipped[worker_id] = clip
        engine.window = window
        engine.anchors[worker_id] = round_number
        c.metrics.staleness.observe(staleness)
        return staleness

    def _verdict(self, window: Round, norm: float) -> tuple[str | None, float]:
        """One arrival against the history and the window's norms, as one server judges it:
        (the refusal or None, its clip); changes nothing."""
        verdict = self.c.screen.verdict(0, [*window.norms.values(), norm])
        return verdict.refused.get(len(window.norms)), verdict.scales[-1]

    def after_commit(self, engine: AsyncArrivals) -> None:
        if engine.window is None:  # the step is made (or nothing was open)
            self.window_tokens.clear()
            self.window_bounds.clear()
            self.window_sessions.clear()
            self.window_clips.clear()

    def on_leave(self, worker_id: str) -> None:
        """A slice never confirmed is in no decision: it goes with its worker."""
        self._drop([k for k in self.held if k[0] == worker_id])

    def drop_pending(self, engine: AsyncArrivals, worker_id: str) -> bool:
        """An admin banned the worker: its arrivals, confirmed or not, are in no step (the
        window folds nothing before it closes)."""
        dropped = self._drop([k for k in self.held if k[0] == worker_id])
        window = engine.window
        if window is not None and worker_id in engine.anchors:
            for pair in [p for p in window.held if p[0].worker_id == worker_id]:
                window.held.remove(pair)
                _release(pair[0])
            for pair in [p for p in window.submitted if p[0] == worker_id]:
                del window.submitted[pair]
            window.tokens -= self.window_tokens.pop(worker_id, 0)
            self.window_bounds.pop(worker_id, None)
            self.window_sessions.pop(worker_id, None)
            self.window_clips.pop(worker_id, None)
            for screened in (window.norms, window.clipped, window.refused):
                screened.pop(worker_id, None)
            if window.submitted:  # the grace deadline counts from the first arrival left
                window.first_submission_at = min(window.submitted.values())
            window.units.pop(worker_id, None)
            window.progress.pop(worker_id, None)
            window.members.discard(worker_id)
            del engine.anchors[worker_id]
            if not window.submitted:
                engine.window = None
            dropped = True
        return dropped


class AsyncFollower(HeldArrivals):
    """Shards 1..S-1: hold slices; apply shard 0's decisions in version order. Membership is
    shard 0's: a follower's steps wait for decisions, not members or a grace window."""

    follows = True

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        # version, worker -> (anchor, session digest)
        self.decided: tuple[int, Contributors] | None = None
        self.screened: DecidedScales | None = None  # how shard 0's robust rule used each

    def start(self, engine: AsyncArrivals) -> None:
        self.kept.clear()
        self.kept.append(self.c.model.current_weights(engine.fragment_rounds()).lend())

    def take_decision(
        self,
        version: int,
        decided: Contributors,
        screened: DecidedScales | None = None,
    ) -> bool:
        """Shard 0 made `version` (the next version here, checked by the engine) from these
        arrivals (worker -> anchor, session digest) and (clipped_mean) with these clips;
        whether it is news (the engine applies it once every one of their slices is here)."""
        if self.decided is not None:
            return False
        self.decided = (version, dict(decided))
        self.screened = screened
        return True

    def _decided_key(self, worker_id: str, anchor: int, digest: str | None):
        """The held slice a decision names: the one of its session (any, for a decision
        that names none)."""
        keys = self._of(worker_id, anchor)
        if digest is not None:
            keys = [k for k in keys if k[2] == digest]
        return max(keys, key=lambda k: self.held[k].at) if keys else None

    def before_commit(self, engine: AsyncArrivals, now: float) -> bool:
        """The decided step may be applied once its slices are all here (lock held): its
        window is built from them, in worker-id order."""
        c = self.c
        if self.decided is None or c.model.masters is None or c.stopped():
            return False
        version, decided = self.decided
        if version != c.model.version:
            self.decided = None  # applied already (a restart found it durable)
            return False
        if engine.window is None:  # (else a step that failed to write: tried again)
            keys = {w: self._decided_key(w, a, d) for w, (a, d) in decided.items()}
            if any(key is None for key in keys.values()):
                return False  # a decided slice is missing here until its worker sends it again
            window = Round(version, set(), c.settings.weighting, now)
            for worker_id, key in sorted(keys.items()):
                assert key is not None
                held = self.held.pop(key)
                window.hold(held.submission, held.scan, now)
                self.window_sessions[worker_id] = held.digest
            self._take_clips(window)
            engine.window = window
            engine.anchors = {w: a for w, (a, _) in decided.items()}
        return True

    def _take_clips(self, window: Round) -> None:
        """The decision's clips (0: refused) and norms, into the window and its record."""
        if self.screened is None:
            return
        self.window_clips.update(self.screened.scales)
        window.refused.update(self.screened.refused())
        window.clipped.update({w: c for w, c in self.screened.scales.items() if 0 < c < 1})
        window.norms.update(self.screened.norms)

    def after_commit(self, engine: AsyncArrivals) -> None:
        """Once the step is made: keep its version, drop the slices it passed."""
        if engine.window is not None:
            return
        assert self.decided is not None
        _, decided = self.decided
        self.decided = None
        self.screened = None
        self.window_sessions.clear()
        self.window_clips.clear()
        self.kept.append(self.c.model.current_weights(engine.fragment_rounds()).lend())
        # these workers' slices of this anchor or older can no longer be decided
        for worker_id, (anchor, _) in decided.items():
            self._drop([k for k in self.held if k[0] == worker_id and k[1] <= anchor])

    def waiting_for(self) -> list[str]:
        """The decided workers whose slices are missing here (the engine: while it has no
        window)."""
        if self.decided is None:
            return []
        _, decided = self.decided
        return sorted(w for w, (a, d) in decided.items() if self._decided_key(w, a, d) is None)

    def poll_result(
        self, engine: AsyncArrivals, round_number: int, worker_id: str | None
    ) -> RoundResult | None:
        """The current weights once this shard has applied (worker, round_number); None
        while it holds that slice. A slice neither held nor applied here is asked for again
        (409 not_submitted): a worker asks only once shard 0 applied its arrival."""
        c = self.c
        if worker_id is None:
            raise Rejection(
                422,
                "invalid_request",
                "field 'worker_id' is required in async mode",
                field="worker_id",
            )
        if c.applied_version(worker_id, round_number) is None:
            if self._of(worker_id, round_number) or c.closing():
                return None
            if round_number > c.model.version:
                raise engine.future_round(round_number)
            raise Rejection(
                409,
                "not_submitted",
                f"this shard holds no slice of {worker_id!r} for version {round_number} "
                "(it restarted since, or it was never sent); submit it again",
                round=round_number,
                worker_id=worker_id,
            )
        return c.model.current_weights(engine.fragment_rounds()).lend()
