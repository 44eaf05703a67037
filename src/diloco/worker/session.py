"""A worker's session with the coordinator: join, submit, await the result, rebase.

It knows the client and the worker's identity, not the model: tensors come in as encoded
bodies and go out as decoded name -> tensor dicts. A network failure retries the same
submission under the same (worker, round, fragment) key (the client's retries), and the
session rides through what the server can say about it on the way: an eviction or a server
restart (register again under the same id, the submission stays or is sent again), work
units leased to others meanwhile (not reported), a result superseded by newer ones (take the
current weights) and a server behind us (rebase: adopt its weights and round, drop the
pending pseudo-gradient). Only rank 0 of a torch.distributed group has a session.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from diloco.wire import TensorSpec, decode_tensors
from diloco.worker.data.units import UnitReports
from diloco.worker.errors import AnchorTorn, ClientClosed, ServerError
from diloco.worker.net.client import DiLoCoClient, Weights

log = logging.getLogger("diloco.worker")

# A result this long in coming is logged with why the server waits (its "waiting" answer),
# and again at most once a minute; DILOCO_WAIT_REPORT_SECONDS (or the worker's
# wait_report_after) sets the first.
WAIT_REPORT_SECONDS = 30.0
WAIT_REPEAT_SECONDS = 60.0
WAIT_REPORT_ENV_VAR = "DILOCO_WAIT_REPORT_SECONDS"
# The longest a leaving worker retries its deregistration (the server evicts it anyway).
LEAVE_SECONDS = 30.0


@dataclass(frozen=True)
class Exchanged:
    """A sync's outcome: the global values to take, and the round they start."""

    tensors: dict[str, torch.Tensor]
    round: int  # sync: the next round; streaming: the fragment's next round; async: a version
    rebase_rounds: list[int] | None = None  # the server was behind: full weights, its rounds
    # Whether the server folded our pseudo-gradient in ("accepted" or "duplicate"): not when
    # the round had committed without it ("committed") or on a rebase
    folded: bool = True


class _LostUnit(Exception):
    """A unit reported with this round is no longer leased to us (an eviction)."""

    def __init__(self, unit: object) -> None:
        super().__init__(f"work unit {unit} is no longer leased to us")
        self.unit = unit


@dataclass
class SubmitAnswer:
    """The server's answer to one exchange's submission ("" until it came), kept by the
    caller: an exchange that fails after it (a wait given up, the server gone) still knows
    whether the body is in its round's sums, which is how its error feedback settles."""

    status: str = ""
    # An earlier body of ours for the same round is in its sums already (a streaming merge
    # gave up on its sync after the server had taken it): a "duplicate" then means that
    # earlier body, not this one.
    earlier_folded: bool = False

    @property
    def folded(self) -> bool:
        """Whether this body is in its round's sums: "accepted", or a "duplicate" retry of
        it; not "committed" (the round went on without it), nor before any answer."""
        if self.status == "duplicate":
            return not self.earlier_folded
        return self.status == "accepted"


def _adopting(weights: Weights) -> Exchanged:
    """The server's whole weights and rounds to adopt, our pseudo-gradient dropped (a rebase:
    nothing of it was folded)."""
    return Exchanged(
        decode_tensors(weights.body),
        weights.round,
        rebase_rounds=weights.fragment_rounds or [weights.round],
        folded=False,
    )


def wait_report_seconds(seconds: float | None = None) -> float:
    """When a sync that is still waiting is first logged: `seconds`, else
    $DILOCO_WAIT_REPORT_SECONDS, else WAIT_REPORT_SECONDS; ValueError for a bad value."""
    name = "wait_report_after"
    if seconds is None:
        name, text = WAIT_REPORT_ENV_VAR, os.environ.get(WAIT_REPORT_ENV_VAR, "").strip()
        if not text:
            return WAIT_REPORT_SECONDS
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    if isinstance(seconds, bool) or not (
        isinstance(seconds, (int, float)) and 0 < seconds < math.inf
    ):
        raise ValueError(f"{name} must be > 0 seconds, got {seconds!r}")
    return float(seconds)


def waiting_text(waiting: Mapping) -> str:
    """Whom an open round waits for, as `diloco status` and the worker's log say it: the
    workers yet to submit, and the submissions --min-workers needs beyond them ("" if none)."""
    parts = [str(w) for w in waiting.get("waiting_for") or []]
    short = waiting.get("more_submissions_needed") or 0
    if short:
        parts.append(f"{short} more submission{'s' if short > 1 else ''} (--min-workers)")
    return ", ".join(parts)


def describe_wait(
    round_number: int,
    fragment: int,
    seconds: float,
    waiting: Mapping,
    heartbeat_timeout: float | None = None,
) -> str:
    """Why a round has not committed yet, from the server's "waiting" answer."""
    what = f"round {round_number}" + (f" of fragment {fragment}" if fragment else "")
    whom = waiting_text(waiting)
    if not whom:
        return f"{what} still open after {seconds:.0f} s: the server is committing it"
    hints = []
    if waiting.get("waiting_for"):
        evicted = "" if heartbeat_timeout is None else f" ({heartbeat_timeout:g} s)"
        hints.append(
            "a worker that stopped is waited for until the server's heartbeat timeout"
            f"{evicted} evicts it"
        )
    if waiting.get("more_submissions_needed"):
        hints.append("the round commits once more workers join and submit")
    return f"{what} still open after {seconds:.0f} s, waiting for: {whom}; " + "; ".join(hints)


class ServerSession:
    """One worker's registration with the server and its exchanges of pseudo-gradients.

    `key` makes a retried registration idempotent (the wire's `session`); a worker resumed
    from its checkpoint brings back its id and what `identity()` gave the checkpoint. `plan`
    is the server's fragment plan in streaming mode (None otherwise). `units` are the work
    units reported with submissions. `reuse_downloads`: each download overwrites the buffer
    of the last one, which the caller has loaded already (sync and async); streaming keeps
    each fragment's result until its merge, from another thread, so it turns this off.
    """

    def __init__(
        self,
        client: DiLoCoClient,
        specs: list[TensorSpec],
        units: UnitReports,
        *,
        worker_id: str | None = None,
        saved_identity: Mapping[str, Any] | None = None,
        result_wait: float = 30.0,
        wait_report_after: float = WAIT_REPORT_SECONDS,
    ) -> None:
        """`saved_identity`: what `identity()` returned to a checkpoint this worker resumes.
        `wait_report_after`: a result that long in coming is logged with why, and again
        every WAIT_REPEAT_SECONDS (at least)."""
        self.client = client
        self.specs = specs
        self.units = units
        self.worker_id = worker_id
        saved_key = (saved_identity or {}).get("session")
        self.key = str(saved_key) if saved_key else secrets.token_hex(16)
        saved_credential = (saved_identity or {}).get("credential")
        if saved_credential:  # refused by the server (a fresh one): the client enrolls again
            client.credential = str(saved_credential)
        self.result_wait = result_wait
        self.wait_report_after = wait_report_after
        self.heartbeat_timeout: float | None = None  # the server's, once joined
        self.plan: list[list[str]] | None = None
        self.reuse_downloads = True
        # With a download codec: (delta body, fragment) -> the new values of the fragment's
        # tensors, computed from our anchor (the worker's Anchor.values_after).
        self.apply_delta: Callable[[bytearray, int], dict[str, torch.Tensor]] | None = None
        self.rebases = 0
        self.dropped_rounds = 0  # rounds that trained units an eviction took (`_drop_round`)
        self._register_lock = threading.Lock()
        self._download: bytearray | None = None  # the last weights' buffer, loaded already

    # ----------------------------------------------------------------- identity

    def identity(self) -> dict[str, Any]:
        """What a checkpoint keeps of this session so that a restart comes back as us (read
        back by the constructor's `saved_identity`): the session key and the credential the
        server issued (the checkpoint file is 0600, like its directory)."""
        identity: dict[str, Any] = {"session": self.key}
        if self.client.credential:
            identity["credential"] = self.client.credential
        return identity

    # ----------------------------------------------------------------- joining

    def info(self) -> dict[str, Any]:
        return self.client.info()

    def register(self) -> dict[str, Any]:
        reply = self.client.register(
            self.worker_id, [s.to_json() for s in self.specs], session=self.key,
            waits_for_initial=True,
        )  # fmt: skip
        self.worker_id = reply["worker_id"]
        return reply

    def rejoin(self) -> None:
        """Come back under the same id after an eviction (the server lost us: its
        `unknown_worker`), which gave our leases back to the pool: the data source lets them
        go too."""
        self.units.evicted()
        with self._register_lock:
            try:
                self.register()
            except ServerError as exc:
                if exc.kind != "worker_id_taken":  # taken: another thread already re-registered
                    raise

    def join(
        self,
        initial_weights: Callable[[], bytes | bytearray],
        heartbeat_timeout: float,
        heartbeat_interval: float,
    ) -> Weights:
        """Register (waiting while our id is still held); the first worker uploads
        `initial_weights()`; everyone starts from the server's weights, returned here."""
        self.heartbeat_timeout = heartbeat_timeout
        with self._register_lock:
            reply = self._register_when_free(heartbeat_timeout, heartbeat_interval)
        told = -math.inf
        while True:
            if reply["needs_initial_weights"]:
                self._upload_initial(initial_weights)
            try:
                return self.fetch_weights()
            except ServerError as exc:
                waited_for = reply.get("initial_upload_by")
                if exc.kind != "no_weights" or waited_for in (None, self.worker_id):
                    raise
            # Another worker is uploading them: wait, registering again (which keeps us live
            # and hands us the upload if that worker has left the run).
            if time.monotonic() - told >= 30:
                told = time.monotonic()
                log.info("waiting for %s to upload the initial weights", waited_for)
            time.sleep(min(1.0, heartbeat_interval))
            with self._register_lock:
                reply = self.register()

    def _upload_initial(self, initial_weights: Callable[[], bytes | bytearray]) -> None:
        """Offer the first global weights (the server told us to)."""
        assert self.worker_id is not None
        try:
            self.client.upload_initial(self.worker_id, initial_weights())
        except ServerError as exc:
            # Another worker won, or ours landed and the answer was lost (a restart):
            # either way the server's copy is what every worker starts from.
            if exc.kind != "weights_exist":
                raise

    def _register_when_free(self, timeout: float, interval: float) -> dict[str, Any]:
        """Register; while our id is held by a live worker (most often an earlier process of
        ours, killed before it saved a checkpoint, that the server has not evicted yet), wait
        for the server to evict it, up to twice its heartbeat timeout, saying so in the log."""
        deadline = time.monotonic() + 2 * timeout + 5
        told = -math.inf
        while True:
            try:
                return self.register()
            except ServerError as exc:
                if exc.kind != "worker_id_taken" or time.monotonic() > deadline:
                    if exc.kind == "worker_id_taken":
                        raise ServerError(
                            exc.status,
                            exc.kind,
                            f"worker id {self.worker_id!r} is still held by a live worker "
                            f"after {2 * timeout + 5:g} s: another process with this id is "
                            "running; give this one another --worker-id",
                        ) from None
                    raise
            if time.monotonic() - told >= 10:
                told = time.monotonic()
                log.warning(
                    "worker id %r is held by a live worker (an earlier process of ours that "
                    "the server has not evicted yet?); waiting for its eviction (heartbeat "
                    "timeout %g s)",
                    self.worker_id,
                    timeout,
                )
            time.sleep(min(1.0, interval))

    def fragment_plan(self) -> list[list[str]]:
        """The server's fragment plan (streaming): which tensors each fragment holds."""
        plan = self.info().get("fragment_plan")
        if not plan:
            raise ServerError(
                200, "invalid_response", "the streaming server states no fragment_plan"
            )
        return plan

    # ----------------------------------------------------------------- the exchange

    def exchange(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        *,
        tokens: int,
        fragment: int = 0,
        cancelled: Callable[[], bool] | None = None,
        progress: dict[int, int] | None = None,
        rebuild: Callable[[], bytearray] | None = None,
        answer: SubmitAnswer | None = None,
    ) -> Exchanged:
        """Submit one pseudo-gradient (of a fragment) and wait for its result, riding through
        evictions, restarts and lost answers; a server behind us is a rebase. `tokens` were
        trained for it; `progress` is the unit under way.

        `rebuild` makes `body` again, byte for byte (a sync fp32 upload: anchor - local, which
        stay put while the round is out). With it, the result is read into the body's own
        buffer once the body is in (weights of the same layout: one model-sized buffer a
        round instead of two), and a resend makes the body again first. `answer`: the
        caller's record of the submission's answer, filled in as it comes (each exchange
        its own: a streaming sync given up on may still be answered beside the next)."""
        progress = dict(progress or {})
        answer = SubmitAnswer() if answer is None else answer
        if self.units.take_lost_training():
            try:
                return self._drop_round(round_number, "units an eviction gave back to the pool")
            except BaseException:
                self.units.keep_lost_training()  # (the next sync drops it)
                raise
        try:
            self._submit(body, units, round_number, fragment, tokens, progress, answer)
            got = self._await_result(
                body, units, round_number, fragment, cancelled, tokens, progress, rebuild,
                answer,
            )  # fmt: skip
            return got if answer.folded else replace(got, folded=False)
        except _LostUnit as lost:
            return self._drop_round(round_number, f"work unit {lost.unit}, no longer ours")
        except ServerError as exc:
            if exc.kind != "future_round":
                raise
            return self._rebase(round_number)

    def _submit(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        fragment: int,
        tokens: int,
        progress: dict[int, int],
        answer: SubmitAnswer,
    ) -> None:
        assert self.worker_id is not None
        while True:
            try:
                reply = self.client.submit(
                    round_number,
                    self.worker_id,
                    body,
                    fragment=fragment,
                    tokens=tokens,
                    units=units,
                    progress=progress,
                )
                answer.status = str(reply.get("status"))
                return
            except ServerError as exc:
                detail = exc.detail if isinstance(exc.detail, dict) else {}
                lost_unit = detail.get("unit_id")
                lost = lost_unit in units or lost_unit in progress
                if exc.kind in ("unit_not_leased", "unknown_unit") and lost:
                    # We were evicted and our leases went back to the pool: the unit is not
                    # ours to report, nor to train on, and this body holds samples of it
                    # that another worker may train too: it is not sent (`_drop_round`).
                    self.units.forget([lost_unit])
                    raise _LostUnit(lost_unit) from None
                if exc.kind != "unknown_worker":
                    raise
                self.rejoin()

    def _await_result(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        fragment: int,
        cancelled: Callable[[], bool] | None,
        tokens: int,
        progress: dict[int, int],
        rebuild: Callable[[], bytearray] | None,
        answer: SubmitAnswer,
    ) -> Exchanged:
        assert self.worker_id is not None
        # (a download into the body's buffer overwrites the body, even one that fails part
        # way; weights of another size than the body's go on into the last weights' buffer)
        last = self._reusable_download()
        shared = rebuild is not None and (last is None or len(last) == len(body))
        into = body if shared else last
        started = time.monotonic()
        next_report = started + self.wait_report_after
        while True:
            if cancelled is not None and cancelled():
                raise ClientClosed(f"the sync of round {round_number} was given up")
            now = time.monotonic()
            if now >= next_report:
                waiting = self.client.last_waiting
                log.warning(
                    describe_wait(
                        round_number, fragment, now - started, waiting, self.heartbeat_timeout
                    )
                )
                next_report = now + max(WAIT_REPEAT_SECONDS, self.wait_report_after)
            try:
                got = self.client.wait_result(
                    round_number,
                    self.worker_id,
                    # no longer than until the next report is due, so that it comes on time
                    wait=min(self.result_wait, max(0.0, next_report - now)),
                    fragment=fragment,
                    into=into,
                    have=round_number if self.apply_delta is not None else None,
                )
            except ServerError as exc:
                if exc.kind == "unknown_worker":
                    self.rejoin()  # our submission stays in the round
                    continue
                if exc.kind == "not_submitted":  # the server restarted without it: send again
                    log.warning("round %d lost our submission; sending it again", round_number)
                    if shared:
                        assert rebuild is not None
                        body = into = rebuild()
                    self._submit(body, units, round_number, fragment, tokens, progress, answer)
                    continue
                if exc.kind == "result_expired":
                    return self.current_weights(fragment)
                raise
            if got is not None:
                self._downloaded(got.body)
                if got.delta_from is not None:
                    if self.apply_delta is None or got.delta_from != round_number:
                        raise ServerError(
                            200,
                            "invalid_response",
                            f"a delta against round {got.delta_from}, but our anchor is at "
                            f"round {round_number}"
                            + ("" if self.apply_delta else " and we asked for none"),
                        )
                    try:
                        return Exchanged(self.apply_delta(got.body, fragment), got.round)
                    except AnchorTorn as exc:
                        log.warning("%s; taking the server's whole weights instead", exc)
                        return self.current_weights(fragment)
                return Exchanged(decode_tensors(got.body), got.round)

    # ----------------------------------------------------------------- whole weights

    def fetch_weights(self) -> Weights:
        """The server's current weights, with the rounds they start."""
        weights = self.client.get_weights_detail(into=self._reusable_download())
        self._downloaded(weights.body)
        return weights

    def drop_download_buffer(self) -> None:
        """Let the last weights' buffer go (loaded already) when no later download fits it:
        kept, it would hold a copy of the model for nothing."""
        self._download = None

    def _reusable_download(self) -> bytearray | None:
        return self._download if self.reuse_downloads else None

    def _downloaded(self, body: bytearray) -> None:
        if self.reuse_downloads:
            self._download = body

    @property
    def download_buffer(self) -> bytearray | None:
        """The buffer the last weights came in (the next download overwrites it)."""
        return self._download

    def current_weights(self, fragment: int = 0) -> Exchanged:
        """The server's current values of `fragment` (every tensor without a plan) and the
        round they start: what a round whose result is gone (newer ones exist), or an anchor
        a delta left torn, takes instead."""
        weights = self.fetch_weights()
        tensors = decode_tensors(weights.body)
        if self.plan is None:
            return Exchanged(tensors, weights.round)
        names = self.plan[fragment]
        rounds = weights.fragment_rounds or [weights.round]
        return Exchanged({n: tensors[n] for n in names}, rounds[fragment])

    def _drop_round(self, round_number: int, why: str) -> Exchanged:
        """This round trained samples of `why` (units an eviction took from us and gave
        back to the pool, for any worker to lease and train): its pseudo-gradient is
        dropped, not sent, so that no sample counts twice, and the worker adopts the
        server's weights and rounds as a rebase does (its other units stay leased to it)."""
        weights = self.fetch_weights()
        log.warning(
            "round %d trained samples of %s: dropping its pseudo-gradient so that no sample "
            "counts twice, adopting the server's weights (round %d)",
            round_number,
            why,
            weights.round,
        )
        self.dropped_rounds += 1
        return _adopting(weights)

    def _rebase(self, round_number: int) -> Exchanged:
        """The server is behind us: it restarted from an older checkpoint (durability interval).

        The pending pseudo-gradient is relative to an anchor the server no longer has, so it is
        dropped; the worker adopts the server's weights and round and trains on from there
        (its inner optimizer state, step count and schedule carry on).
        """
        weights = self.fetch_weights()
        log.warning(
            "the server is at round %d, behind our round %d (it restarted from an older "
            "checkpoint): adopting its weights, dropping this round's pseudo-gradient",
            weights.round,
            round_number,
        )
        self.rebases += 1
        return _adopting(weights)

    # ----------------------------------------------------------------- leaving

    def leave(self) -> None:
        """Deregister (best effort: eviction would follow) and close the connections. The
        deregistration retries for LEAVE_SECONDS at most, whatever the run's retry policy
        (which may retry forever): a server gone for good must not hang `close`."""
        policy = self.client.retry
        if policy.deadline is None or policy.deadline > LEAVE_SECONDS:
            self.client.retry = replace(policy, deadline=LEAVE_SECONDS)
        try:
            self.client.deregister(self.worker_id)  # type: ignore[arg-type]
        except Exception as exc:
            log.warning("deregister failed: %s", exc)
        self.client.close()
