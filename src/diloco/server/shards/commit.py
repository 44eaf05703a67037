"""A shard's part in the cross-shard commit of sync rounds (server/shards/sync_decisions.py).

Shard 0 confirms a worker once every other shard holds its slice of the round (asked outside
the lock, so a slow shard holds back nobody else's calls) and answers the decisions it made;
every shard answers whether it holds a slice; the other shards apply shard 0's decisions.
No HTTP here: the peers are an injected `ShardPeers`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from diloco import faults
from diloco.server.errors import Rejection
from diloco.server.members.membership import Membership
from diloco.server.model.results import RoundResult
from diloco.server.rounds.engine import ShardEngine
from diloco.server.rounds.robust import Contributors, DecidedScales, ScreeningPart
from diloco.server.shards.peers import PeerUnavailable
from diloco.server.shards.role import ShardRole
from diloco.server.state.journal import RoundJournal
from diloco.wire import TensorSpec

MAX_DECISION_WAIT = 60.0


class ShardCommit:
    """Confirmations and decisions across shards, under the coordinator's lock."""

    def __init__(
        self,
        lock: threading.Condition,
        engine: ShardEngine,
        role: ShardRole,
        membership: Membership,
        journal: RoundJournal,
        clock: Callable[[], float],
        require_healthy: Callable[[], None],
        remove_worker: Callable[..., None],
        closing: Callable[[], bool] = lambda: False,
        paused: Callable[[], bool] = lambda: False,
        follow_pause: Callable[[bool], bool] = lambda paused: False,
        pause_stamp: Callable[[], int] = lambda: 0,
    ) -> None:
        """`remove_worker`: ends a worker's membership here (the registrar's `remove`; a
        streaming follower's evictions). `paused`: whether this shard's rounds are paused;
        `follow_pause(paused)`: a streaming follower pauses or resumes as shard 0 did (lock
        held; whether that changed anything); `pause_stamp`: shard 0's, the stamp of its last
        pause or resume (ops/control.py)."""
        self.lock = lock
        self.engine = engine
        self.role = role
        self.membership = membership
        self.journal = journal
        self.peers = role.peers
        self.clock = clock
        self.require_healthy = require_healthy
        self.remove_worker = remove_worker
        self.closing = closing
        self.paused = paused
        self.follow_pause = follow_pause
        self.pause_stamp = pause_stamp
        self.pause_stamp_taken = -1  # a follower: the stamp of shard 0's last word it took
        self.whole_model: str | None = None  # the --init model's fingerprint, if started so

    def _require_decisions(self) -> None:
        if not self.role.decides:
            raise Rejection(
                409,
                "not_applicable",
                "streaming shards commit each fragment's rounds on the shard that owns it: "
                "nothing is confirmed or decided across shards",
            )

    def require_datasets(self) -> None:
        """Streaming shards lease no work units: a fragment's submission, which would report
        them, may go to a shard other than shard 0, which keeps the datasets."""
        if not self.role.decides:
            raise Rejection(
                409,
                "not_built",
                "sharded servers in streaming mode do not lease work units (a fragment's "
                "submission may go to a shard that keeps no dataset); give each worker its "
                "own data (diloco worker --data-dispatch static)",
            )

    def whole_plan(self) -> dict:
        """Shard 0 (streaming): the whole model's fragment plan, once fixed (null before)."""
        if not self.leads:
            raise Rejection(409, "not_shard_0", "the fragment plan is shard 0's")
        with self.lock:
            return {"plan": self.journal.state.get_meta("whole_fragment_plan")}

    def live_members(self) -> dict:
        """Shard 0: the workers live here (streaming followers evict the rest), and whether
        its rounds are paused (they pause too)."""
        if not self.leads:
            raise Rejection(409, "not_shard_0", "membership is shard 0's")
        with self.lock:
            return {
                "live": sorted(self.membership.live_ids()),
                "paused": self.paused(),
                "pause_stamp": self.pause_stamp(),
            }

    def follow_members(
        self,
        live: set[str],
        asked_at: float,
        paused: bool | None = None,
        stamp: int | None = None,
    ) -> None:
        """A streaming follower: evict the workers shard 0 no longer holds live (asked at
        `asked_at`; one registered or heard from since then waits for the next question,
        since it may have registered on shard 0 after the answer), and pause or resume as
        shard 0 is, unless a newer word of shard 0's came first (`stamp`)."""
        with self.lock:
            for worker_id in sorted(set(self.membership.live_ids()) - live):
                record = self.membership.get_live(worker_id)
                if record is not None and record.last_seen < asked_at:
                    self.remove_worker(worker_id, "evicted_on_shard_0")
            if paused is not None:
                self._take_word(paused, stamp)
            self.lock.notify_all()

    def _take_word(self, paused: bool, stamp: int | None) -> bool:
        """Pause or resume as shard 0 said, unless a word stamped later was taken already
        (a push and an answer, or two pushes, may arrive in either order); a word without a
        stamp is taken as it comes. Whether anything changed (lock held)."""
        if stamp is not None and stamp <= self.pause_stamp_taken:
            return False
        changed = self.follow_pause(paused)  # (a failure leaves the word to be taken again)
        if stamp is not None:
            self.pause_stamp_taken = stamp
        return changed

    def told_paused(self, paused: bool, stamp: int | None = None) -> dict:
        """A streaming follower: shard 0's admin paused or resumed the rounds (shard 0
        tells every shard at once). The answer says this shard's state after the word, which
        a word older than one already taken leaves as it was."""
        if self.leads or self.role.mode != "streaming":
            raise Rejection(
                409,
                "not_applicable",
                "only the other shards of streaming servers follow shard 0's pause",
            )
        with self.lock:
            changed = self._take_word(paused, stamp)
            self.lock.notify_all()
            return {"paused": self.paused(), "changed": changed}

    def info(self, specs: Mapping[str, TensorSpec] | None) -> dict:
        """Where the model's parts live, for a worker that knows one shard's URL: every
        shard's URL, and the tensors this one owns (once the model is known)."""
        settings = self.journal.settings
        plan = (
            self.journal.state.get_meta("fragment_plan") if settings.mode == "streaming" else None
        )
        return {
            "index": settings.shard,
            "urls": list(settings.shard_urls),
            "owned": None if specs is None else list(specs),
            "whole_model": self.whole_model,
            # streaming: the fragments (numbered as in the whole model's plan) this shard owns
            "fragments": None if plan is None else [f for f, names in enumerate(plan) if names],
        }

    def open_round(self) -> int | None:
        """The round this shard has open (None before the weights exist; sync, async)."""
        with self.lock:
            return self.engine.open_number()

    @property
    def leads(self) -> bool:
        return self.role.leads

    def _open_round(self) -> int:
        number = self.engine.open_number()
        if number is None:
            raise Rejection(409, "no_weights", "no global weights yet; nothing to confirm")
        return number

    def confirm(self, worker_id: str, round_number: int) -> dict:
        """Shard 0: `worker_id` says every shard holds its slice of `round_number` (async: of
        the arrival whose anchor is that version); checked with each shard, it then counts
        for the round's barrier (joins the grace window). 409 `not_prepared` names the
        shards that lack it (send it there again, then confirm again)."""
        self._require_decisions()
        if not self.leads:
            raise Rejection(
                409, "not_shard_0", "confirmations go to shard 0, which decides the rounds"
            )
        with self.lock:
            self.require_healthy()
            self.membership.require_live(worker_id).last_seen = self.clock()
            settled = self._settled(worker_id, round_number)
            if settled is not None:
                return settled
            held = self.engine.holds(worker_id, round_number)
            if held is None:
                raise Rejection(
                    409,
                    "not_submitted",
                    f"shard 0 holds no slice of round {round_number} from {worker_id!r}; "
                    "submit it, then confirm",
                    round=round_number,
                    worker_id=worker_id,
                )
        assert self.peers is not None
        try:  # outside the lock: other workers' calls go on meanwhile
            missing, bound, squares = self.peers.missing_slices(
                round_number, worker_id, *held, screened=self.journal.settings.robust.screens
            )
        except PeerUnavailable as exc:
            raise Rejection(
                503, "shard_unavailable", f"a shard cannot be reached: {exc}", round=round_number
            ) from None
        if missing:
            raise Rejection(
                409,
                "not_prepared",
                f"shard(s) {', '.join(map(str, missing))} hold no slice of round {round_number} "
                f"from {worker_id!r} with {held[0]} tokens from this process; submit it there, "
                "then confirm",
                shards=missing,
                round=round_number,
                worker_id=worker_id,
            )
        with self.lock:
            settled = self._settled(worker_id, round_number)  # (a retry confirmed it meanwhile)
            if settled is not None:
                return settled
            if self.engine.holds(worker_id, round_number) != held:
                raise Rejection(
                    409,
                    "not_submitted",
                    f"shard 0 no longer holds {worker_id!r}'s slice of round {round_number}",
                    round=round_number,
                    worker_id=worker_id,
                )
            bound = max(bound, self.engine.bound_of(worker_id, round_number))
            answer = self.engine.confirm(worker_id, round_number, bound, squares)
            self.lock.notify_all()  # (a round it completed may now ask the shards' parts)
            return answer

    def _settled(self, worker_id: str, round_number: int) -> dict | None:
        """The answer to a confirmation with nothing left to confirm (lock held): its round
        committed, or (async) its arrival was applied or already joined the window; None
        when the slice may be confirmed now. 409 for a round not started."""
        current = self._open_round()
        if round_number > current:
            raise Rejection(
                409,
                "future_round",
                f"round {round_number} has not started; the current round is {current}",
                current_round=current,
            )
        if self.role.mode == "async":  # (shard 0: the arrival was applied, or is pending)
            applied = self.journal.state.applied_version(worker_id, round_number)
            if applied is None and self.engine.pending_anchor(worker_id) != round_number:
                return None
            return {
                "status": "duplicate",
                "round": round_number,
                "current_round": current,
                "applied_version": applied,
            }
        if round_number < current:
            return self._after_commit(worker_id, round_number)
        return None

    def _after_commit(self, worker_id: str, round_number: int) -> dict:
        """A confirmation of a round that has committed (a retry whose answer was lost, or a
        round that went on without us): "duplicate" when its decision used our slices, so
        that the worker knows its pseudo-gradient was folded, else "committed"."""
        contributors = self.journal.state.contributors_of(round_number) or []
        status = "duplicate" if worker_id in contributors else "committed"
        current = self.engine.open_number()
        return {"status": status, "round": round_number, "current_round": current}

    def member(self, worker_id: str, session: str) -> dict:
        """Shard 0: whether `worker_id` is live here under `session` (asked by a shard that
        still holds the id under an older session)."""
        if not self.leads:
            raise Rejection(409, "not_shard_0", "membership is shard 0's")
        with self.lock:
            record = self.membership.get_live(worker_id)
            return {
                "worker_id": worker_id,
                "live": record is not None,
                "session_matches": record is not None and (record.session or "") == session,
            }

    def prepared(self, round_number: int, worker_id: str, digest: str | None = None) -> dict:
        """Whether this shard holds `worker_id`'s slice of `round_number` (from the process
        whose session digest is `digest`, when given), with its tokens."""
        self._require_decisions()
        with self.lock:
            held = self.engine.holds(worker_id, round_number, digest)
            tokens, session = (None, None) if held is None else held
            bound = self.engine.bound_of(worker_id, round_number, digest)
            squares = (
                None if held is None else self.engine.squares_of(worker_id, round_number, digest)
            )
            return {
                "bound": None if held is None else bound,
                # robust aggregation: the sum of squares of the slice's trained values
                "norm_squares": squares,
                "round": round_number,
                "current_round": self.engine.open_number(),
                "worker_id": worker_id,
                "prepared": held is not None,
                "tokens": tokens,
                "session_digest": session,
            }

    def decision(self, round_number: int, wait: float, shard: int | None = None) -> dict:
        """Shard 0: the contributors of round `round_number` once it committed (durable
        before this can answer) and how a robust rule used each, long-polling up to `wait`
        seconds while it is open; at once, while its screening waits for `shard`'s part
        (the asking shard), the slices to sum it over."""
        self._require_decisions()
        if not self.leads:
            raise Rejection(409, "not_shard_0", "decisions are shard 0's")
        wait = min(max(0.0, wait), MAX_DECISION_WAIT)
        with self.lock:
            deadline = self.clock() + wait
            while True:
                contributors = self.journal.state.contributors_of(round_number)
                if contributors is not None:
                    used = self.journal.state.submissions_of(round_number)
                    scales, norms = self.journal.state.screened_of(round_number)
                    # robust aggregation: each one's scale (0: refused) and norm
                    screened = {"scales": scales, "norms": norms} if scales else {}
                    return {
                        "status": "decided",
                        "round": round_number,
                        "contributors": contributors,
                        # the round each was sent for (async: its anchor version)
                        "anchors": {row["worker_id"]: row["round"] for row in used},
                        # whose process each one's slices came from (a session digest)
                        "sessions": self.journal.state.sessions_of(round_number),
                        **screened,
                    }
                screening = self.engine.screening(round_number)
                if screening is not None and shard is not None and shard not in screening.answered:
                    return {
                        "status": "screening",
                        "round": round_number,
                        "kept": screening.kept_slices(),
                        "answered": sorted(screening.answered),
                    }
                current = self.engine.open_number()
                if current is not None and round_number > current:
                    raise Rejection(
                        409,
                        "future_round",
                        f"round {round_number} has not started; the current round is {current}",
                        current_round=current,
                    )
                remaining = deadline - self.clock()
                if remaining <= 0 or self.closing():  # shutting down: answer at once
                    return {"status": "waiting", "round": round_number}
                self.lock.wait(timeout=min(remaining, 1.0))

    @staticmethod
    def _exact(shard: ShardCommit | None) -> ShardEngine:
        """The engine that serves exact versions: a shard's in async mode; else 422."""
        if shard is None or not shard.role.serves_versions:
            raise Rejection(
                422,
                "invalid_request",
                "field 'version' is for sharded servers in async mode, where a worker takes "
                "every shard's part of one version",
                field="version",
            )
        return shard.engine

    @staticmethod
    def weights_at(shard: ShardCommit | None, version: int) -> RoundResult:
        """GET /v1/weights?version=V (lock held): exactly version V's weights, the current
        ones or one a follower kept; 409 future_round (not reached yet) or version_gone."""
        return ShardCommit._exact(shard).weights_at(version)

    @staticmethod
    def poll_version(
        shard: ShardCommit | None, version: int
    ) -> Callable[[int, int, str | None, float], RoundResult | None]:
        """A result poll that answers only with exactly `version`'s weights (lock held)."""
        engine = ShardCommit._exact(shard)
        return lambda round_number, _fragment, worker_id, now: engine.poll_version(
            round_number, worker_id, version, now
        )

    def apply_decision(
        self,
        round_number: int,
        anchors: Contributors,
        screened: DecidedScales | None = None,
    ) -> None:
        """A follower: shard 0 decided `round_number` with these contributors (worker -> the
        round it sent for, and its session digest) and (robust aggregation) how it used
        each; commit it when their slices are here."""
        assert self.role.follows and self.role.decides
        with self.lock:
            if self.engine.apply_decision(round_number, anchors, screened):
                self.lock.notify_all()

    def screening_part(self, round_number: int, kept: dict[str, str]) -> ScreeningPart | None:
        """A follower (sync, robust aggregation): its part of shard 0's screening of the
        `kept` slices of `round_number` (None: not its open round, or one is not here)."""
        with self.lock:
            part = self.engine.screening_part(round_number, kept)
        faults.crash_point("screening_part")  # (summed, not yet sent to shard 0)
        return part

    def take_part(self, round_number: int, part: ScreeningPart, shard: int) -> dict:
        """Shard 0: `shard`'s part of the open round's screening; the round may then commit.
        409 `screening_changed` for a part over other slices or of another round."""
        self._require_decisions()
        if not self.leads:
            raise Rejection(409, "not_shard_0", "shard 0 screens the rounds")
        count = len(self.journal.settings.shard_urls)
        if not 0 < shard < count:
            raise Rejection(
                422,
                "invalid_request",
                f"field 'shard' must name another shard, in [1, {count - 1}], got {shard}",
                field="shard",
            )
        with self.lock:
            self.require_healthy()
            faults.crash_point("screening_part_arrived")  # (a part came, not yet taken)
            taken = self.engine.take_part(round_number, shard, part)
            self.lock.notify_all()
            status = "missing" if part.missing else "taken" if taken else "duplicate"
            return {"status": status, "round": round_number}
