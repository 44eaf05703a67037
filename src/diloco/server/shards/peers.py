"""What a shard asks the other shards: server-to-server calls on loopback or a cluster link.

Shard 0 asks every other shard whether it holds a worker's slice of a round (before the
worker counts for the barrier); the other shards ask shard 0 for each round's decision, and
compare their settings with shard 0's when they start. Every call has a timeout; a shard that
does not answer is a `PeerUnavailable`, which the caller turns into a retryable 503.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode

import urllib3

from diloco.server.rounds.robust import Contributors, DecidedScales, ScreeningPart
from diloco.server.settings import DESCRIPTIVE_SETTINGS
from diloco.wire.validation import PROTOCOL_HEADER, PROTOCOL_VERSION

log = logging.getLogger("diloco.server")
CALL_TIMEOUT = 10.0  # seconds to connect, and to read beyond a long-poll's own wait


class PeerUnavailable(Exception):
    """A shard did not answer (down, restarting, or refusing): the step waits for it.
    `status` is the HTTP status of an answer that refused (None: no answer)."""

    def __init__(self, message: str, status: int | None = None, tls: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.tls = tls  # the TLS handshake failed (a certificate not trusted)


class ShardPeers:
    """Calls of the other shards' /v1/shard routes, with the shards' own secret (scope
    `shard` of --tokens-file: server/members/credentials.py) and, for https:// shard URLs,
    the certificates `ca_file` signs (None: the system's trusted ones)."""

    def __init__(
        self,
        urls: Sequence[str],
        index: int,
        secret: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.index = index
        self.secured = bool(secret)  # it calls with a secret (its own routes need one too)
        self._anonymous = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        self._headers = {
            **self._anonymous,
            **({"Authorization": f"Bearer {secret}"} if secret else {}),
        }
        # Shard 0 asks the others for every confirmation, from many request threads at once.
        self._pool = urllib3.PoolManager(
            num_pools=len(urls),
            maxsize=64,
            retries=False,
            **({"ca_certs": ca_file, "cert_reqs": "CERT_REQUIRED"} if ca_file else {}),
        )
        self._asking = ThreadPoolExecutor(4 * len(urls), thread_name_prefix="diloco-peers")

    def _get(
        self,
        shard: int,
        path: str,
        query: Mapping[str, Any],
        wait: float = 0.0,
        anonymous: bool = False,
        posted: Mapping[str, Any] | None = None,
    ) -> dict:
        """GET `path` of `shard` with `query` (POST with the JSON body `posted` when given)."""
        url = f"{self.urls[shard]}{path}?{urlencode(query)}"
        timeout = urllib3.Timeout(connect=CALL_TIMEOUT, read=CALL_TIMEOUT + wait)
        headers = self._anonymous if anonymous else self._headers
        method = "GET" if posted is None else "POST"
        try:
            response = self._pool.request(
                method, url, headers=headers, json=posted, timeout=timeout
            )
        except urllib3.exceptions.SSLError as exc:
            raise PeerUnavailable(
                f"the TLS certificate of shard {shard} at {self.urls[shard]} is not trusted "
                f"({exc}): give every shard --ca-file with the certificate (or CA) that signs "
                "the other shards'",
                tls=True,
            ) from None
        except urllib3.exceptions.HTTPError as exc:
            raise PeerUnavailable(
                f"shard {shard} at {self.urls[shard]} did not answer: {exc}"
            ) from None
        try:
            body = json.loads(response.data or b"{}")
        except ValueError:
            body = {}
        if response.status >= 300 or not isinstance(body, dict):
            raise PeerUnavailable(
                f"shard {shard} at {self.urls[shard]} answered {response.status}: "
                f"{body.get('error') if isinstance(body, dict) else response.data[:200]!r}",
                status=response.status,
            )
        return body

    def missing_slices(
        self,
        round_number: int,
        worker_id: str,
        tokens: int,
        session_digest: str,
        screened: bool = False,
    ) -> tuple[list[int], float, float]:
        """The other shards that do not hold `worker_id`'s slice of `round_number` with
        `tokens` from the same process (session) as shard 0's (its call, before it confirms
        the worker), all asked at once; the largest bound of the slices' values that the
        shards holding one state; and (`screened`: robust aggregation) the sum of the
        squares they state of their slices' trained values, which each must state."""
        others = [shard for shard in range(len(self.urls)) if shard != self.index]
        query = {"round": round_number, "worker_id": worker_id, "session_digest": session_digest}
        answers = list(
            self._asking.map(lambda s: self._get(s, "/v1/shard/prepared", query), others)
        )
        missing = [
            shard
            for shard, held in zip(others, answers, strict=True)
            if not held.get("prepared")
            or held.get("tokens") != tokens
            or held.get("session_digest") != session_digest
        ]
        bounds = [held.get("bound") for held in answers if held.get("prepared")]
        if any(not isinstance(b, (int, float)) for b in bounds):
            raise PeerUnavailable("a shard stated no bound of the slice's values")
        squares = [held.get("norm_squares") for held in answers if held.get("prepared")]
        if not screened:
            return missing, float(max(bounds, default=0.0)), 0.0
        if not all(_number_in(q, 0.0, math.inf) for q in squares):
            raise PeerUnavailable(
                "a shard stated no sum of squares of the slice's values (does it run the same "
                "--aggregation?)"
            )
        return missing, float(max(bounds, default=0.0)), float(sum(squares))

    def decision(self, round_number: int, wait: float) -> ShardDecision | None:
        """Shard 0's word on `round_number`: its decision (the contributors, each with the
        round it sent for (async: its anchor version) and the digest of the session its
        slices came from, and how a robust rule used each), or its request for this shard's
        part of the round's screening; None while open."""
        query = {"wait": wait, "shard": self.index}
        answer = self._get(0, f"/v1/shard/decisions/{round_number}", query, wait)
        malformed = PeerUnavailable(f"shard 0's decision of round {round_number} is malformed")
        if answer.get("status") == "screening":
            kept = answer.get("kept")
            if not isinstance(kept, dict) or not all(isinstance(d, str) for d in kept.values()):
                raise malformed
            return ShardDecision(screening={str(w): d for w, d in kept.items()})
        contributors, anchors = answer.get("contributors"), answer.get("anchors")
        sessions = answer.get("sessions") or {}
        if answer.get("status") != "decided" or not isinstance(contributors, list):
            return None
        if not isinstance(anchors, dict) or set(anchors) != set(map(str, contributors)):
            raise malformed
        if not isinstance(sessions, dict):
            raise malformed
        decided = {
            str(worker): (int(anchors[worker]), sessions.get(worker)) for worker in contributors
        }
        scales, norms = answer.get("scales", {}), answer.get("norms", {})
        if not isinstance(scales, dict) or not isinstance(norms, dict):
            raise malformed
        if not set(scales) <= set(decided) or not set(norms) <= set(decided):
            raise malformed
        if not all(_number_in(v, 0.0, 1.0) for v in scales.values()):
            raise malformed
        if not all(_number_in(v, 0.0, math.inf) for v in norms.values()):
            raise malformed
        screened = None
        if scales:
            screened = DecidedScales(
                {str(w): float(v) for w, v in scales.items()},
                {str(w): float(v) for w, v in norms.items()},
            )
        return ShardDecision(decided, screened)

    def send_part(self, round_number: int, part: ScreeningPart) -> None:
        """This shard's part of shard 0's screening of `round_number`."""
        body = {
            "shard": self.index,
            "kept": part.kept,
            "dots": part.dots,
            "squares": part.squares,
            "median_squares": part.median_squares,
            "missing": list(part.missing),
        }
        self._get(0, f"/v1/shard/screening/{round_number}", {}, posted=body)

    def member_session(self, worker_id: str, session: str) -> bool:
        """Whether shard 0 holds `worker_id` live under `session`."""
        answer = self._get(0, "/v1/shard/members", {"worker_id": worker_id, "session": session})
        return bool(answer.get("session_matches"))

    def whole_plan(self) -> list[list[str]] | None:
        """Shard 0's whole fragment plan (streaming), or None before it has one."""
        plan = self._get(0, "/v1/shard/plan", {}).get("plan")
        if plan is not None and not (
            isinstance(plan, list)
            and all(isinstance(f, list) and all(isinstance(n, str) for n in f) for f in plan)
        ):
            raise PeerUnavailable("shard 0's fragment plan is malformed")
        return plan

    def live_members(self) -> tuple[set[str], bool | None, int | None]:
        """The workers shard 0 holds live, whether its rounds are paused and the stamp of
        that word (None: a shard 0 that does not say)."""
        answer = self._get(0, "/v1/shard/live", {})
        live, paused, stamp = answer.get("live"), answer.get("paused"), answer.get("pause_stamp")
        stamp_ok = stamp is None or (isinstance(stamp, int) and not isinstance(stamp, bool))
        if not isinstance(live, list) or not isinstance(paused, (bool, type(None))) or not stamp_ok:
            raise PeerUnavailable("shard 0's list of live workers is malformed")
        return {str(worker) for worker in live}, paused, stamp

    def tell_paused(self, paused: bool, stamp: int) -> list[int]:
        """Shard 0 (streaming): every other shard pauses or resumes its rounds now, all asked
        at once; the shards that did not answer (they follow on their next question of who
        is live, `MembershipFollower`)."""
        others = [shard for shard in range(len(self.urls)) if shard != self.index]

        def tell(shard: int) -> int | None:
            try:
                self._get(shard, "/v1/shard/paused", {}, posted={"paused": paused, "stamp": stamp})
            except PeerUnavailable as exc:
                log.warning("shard %d was not told the rounds are %s: %s", shard,
                            "paused" if paused else "resumed", exc)  # fmt: skip
                return shard
            return None

        return [shard for shard in self._asking.map(tell, others) if shard is not None]

    def leader_info(self) -> dict:
        return self._get(0, "/v1/info", {})

    def leader_is_open(self) -> bool:
        """Whether shard 0 answers a call that carries no secret (it has none configured)."""
        try:
            self._get(0, "/v1/info", {}, anonymous=True)
        except PeerUnavailable as exc:
            if exc.status in (401, 403):
                return False
            raise
        return True

    def close(self) -> None:
        self._pool.clear()
        self._asking.shutdown(wait=False)


def _number_in(value: object, low: float, high: float) -> bool:
    """Whether a value of a peer's JSON answer is a finite number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and low <= value <= high


def settings_difference(mine: Mapping[str, Any], leader: Mapping[str, Any]) -> str | None:
    """The first setting that differs between two shards' /v1/info settings, in words: the
    mode and the codecs first, as others follow them (outer optimizer, error feedback)."""
    keys = sorted((set(mine) | set(leader)) - DESCRIPTIVE_SETTINGS)
    causes = [key for key in ("mode", "upload_codec", "download_codec") if key in keys]
    for key in causes + [key for key in keys if key not in causes]:
        if mine.get(key) != leader.get(key):
            return f"{key} is {mine.get(key)!r} here and {leader.get(key)!r} on shard 0"
    return None


def wait_for_leader(peers: ShardPeers, settings: Mapping[str, Any], timeout: float) -> dict:
    """Shard 0's /v1/info once it answers (up to `timeout` seconds); ValueError naming the
    first setting that differs from ours, so a shard started otherwise refuses to start."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = peers.leader_info()
            # a shard with secrets asks once more without any: does shard 0 take that too?
            leader_open = peers.secured and peers.leader_is_open()
            break
        except PeerUnavailable as exc:
            if exc.tls:  # waiting cannot make a certificate trusted
                raise ValueError(str(exc)) from None
            if exc.status in (401, 403):
                what = "refused this shard's secret"
                if not peers.secured:
                    what = "needs a secret and this shard has none"
                raise ValueError(
                    f"shard 0 {what} ({exc}): start every shard with the same --tokens-file "
                    "(its 'SECRET shard' line)"
                ) from None
            if time.monotonic() > deadline:
                raise ValueError(f"shard 0 did not answer within {timeout:g} s ({exc})") from None
            time.sleep(0.2)
    if leader_open:
        raise ValueError(
            "shard 0 runs without secrets and this shard with them: start every shard with "
            "the same --tokens-file (its 'SECRET shard' line), or none"
        )
    difference = settings_difference(settings, info.get("settings") or {})
    if difference is not None:
        raise ValueError(f"this shard's settings differ from shard 0's: {difference}")
    return info


@dataclass(frozen=True)
class ShardDecision:
    """Shard 0's word on a round: decided (`contributors`, and how a robust rule used each),
    or asking for this shard's part of its screening of the `screening` slices."""

    contributors: Contributors | None = None
    screened: DecidedScales | None = None
    screening: dict[str, str] | None = None  # worker -> session digest


class FollowsDecisions(Protocol):
    """What a follower's loop asks of its shard (server/shards/commit.py's ShardCommit)."""

    def open_round(self) -> int | None: ...

    def apply_decision(
        self,
        round_number: int,
        anchors: Contributors,
        screened: DecidedScales | None = None,
    ) -> None: ...

    def screening_part(self, round_number: int, kept: dict[str, str]) -> ScreeningPart | None: ...


class DecisionFollower(threading.Thread):
    """A follower shard's loop: long-poll shard 0 for the decision of our open round and hand
    it to the shard to apply, or (robust aggregation) send shard 0 the shard's part of the
    round's screening when it asks; unanswered calls are retried after a short pause."""

    def __init__(self, peers: ShardPeers, shard: FollowsDecisions, wait: float = 10.0) -> None:
        super().__init__(name="diloco-shard-decisions", daemon=True)
        self.peers = peers
        self.shard = shard
        self.wait = wait
        self.stopped = threading.Event()
        self._told_missing = 0.0  # when lacking a screened slice was last said

    def run(self) -> None:
        told = 0.0
        while not self.stopped.is_set():
            round_number = self.shard.open_round()
            if round_number is None:
                self.stopped.wait(0.2)
                continue
            try:
                answer = self.peers.decision(round_number, self.wait)
                if answer is not None and answer.screening is not None:
                    self._send_part(round_number, answer.screening)
                    continue
            except PeerUnavailable as exc:
                if time.monotonic() - told > 30:
                    told = time.monotonic()
                    log.warning("waiting for shard 0's decision of round %d: %s", round_number, exc)
                self.stopped.wait(0.5)
                continue
            if answer is not None and answer.contributors is not None:
                try:
                    self.shard.apply_decision(round_number, answer.contributors, answer.screened)
                except Exception:  # a failed step (a disk): said, and tried again
                    log.exception("applying shard 0's decision of round %d failed", round_number)
                    self.stopped.wait(1.0)
                    continue
                # still open: a decided slice is missing here until its worker sends it again
                self.stopped.wait(0.2 if self.shard.open_round() == round_number else 0.0)

    def _send_part(self, round_number: int, kept: dict[str, str]) -> None:
        """Shard 0 screens these slices: this shard's part of the check, once all are here
        (a missing one is named, so that shard 0 tells its worker to send it again)."""
        try:
            part = self.shard.screening_part(round_number, kept)
        except Exception:  # a slice that cannot be read (a disk): said, and tried again
            log.exception("this shard's part of the screening of round %d failed", round_number)
            self.stopped.wait(1.0)
            return
        if part is None:  # (not our open round: it moved on meanwhile)
            self.stopped.wait(0.2)
            return
        try:
            self.peers.send_part(round_number, part)
        except PeerUnavailable as exc:  # (the screening changed: asked again)
            log.info("shard 0 did not take this shard's part of round %d: %s", round_number, exc)
            self.stopped.wait(0.2)
            return
        if part.missing:  # their workers are told to send them again; then we are asked again
            if time.monotonic() - self._told_missing > 30:
                self._told_missing = time.monotonic()
                log.warning(
                    "round %d is screened with slices this shard lacks (from %s): waiting for "
                    "them to be sent again",
                    round_number,
                    ", ".join(part.missing),
                )
            self.stopped.wait(0.5)

    def stop(self) -> None:
        self.stopped.set()


class MembershipFollower(threading.Thread):
    """A follower shard's loop in streaming mode, where each shard commits the rounds of its
    own fragments: every `interval` seconds it asks shard 0 (which takes the heartbeats) who
    is live and whether its rounds are paused, and `follow(live, asked_at, paused, stamp)` evicts
    here whom shard 0 no longer holds, so no barrier here waits for a worker that is gone,
    and pauses or resumes as shard 0 is (a shard that missed shard 0's word follows here)."""

    def __init__(
        self,
        peers: ShardPeers,
        follow: Callable[[set[str], float, bool | None, int | None], None],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="diloco-shard-members", daemon=True)
        self.peers = peers
        self.follow = follow
        self.clock = clock  # the coordinator's, which its workers' last_seen are in
        self.interval = max(0.05, interval)
        self.stopped = threading.Event()
        self._told = 0.0  # when a failure to ask shard 0 was last said

    def run(self) -> None:
        """Asks at once (a follower started while shard 0 is paused pauses before its first
        interval has passed), then every interval."""
        while True:
            self._ask()
            if self.stopped.wait(self.interval):
                return

    def _ask(self) -> None:
        asked_at = self.clock()
        try:
            live, paused, stamp = self.peers.live_members()
        except PeerUnavailable as exc:
            if time.monotonic() - self._told > 30:
                self._told = time.monotonic()
                log.warning("cannot ask shard 0 who is live: %s", exc)
            return
        try:
            self.follow(live, asked_at, paused, stamp)
        except Exception:  # said, and asked again
            log.exception("following shard 0's membership failed")

    def stop(self) -> None:
        self.stopped.set()
