"""The worker's HTTP client for the coordinator's wire protocol (docs/protocol.md, version 1).

It speaks bytes for tensor bodies (the caller encodes and decodes safetensors) and plain dicts
for JSON, so it knows nothing of torch or of the wire schemas. Transport failures, 429, 502,
503 and 504 (the server's own `barrier_timeout` included) are retried under a RetryPolicy,
re-sending the very same body: the server deduplicates by (worker, round, fragment), so a
resubmission is safe and a worker never loses its progress to a dropped connection.

urllib3 is used because it uploads a bytes body and streams a download at loopback speed
(docs: DESIGN.md); bodies go out as one buffer and come back into one preallocated buffer.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import urllib3
from urllib3.exceptions import ProtocolError, ProxyError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from diloco.wire.validation import PROTOCOL_HEADER, PROTOCOL_VERSION
from diloco.worker.auth import BearerAuth
from diloco.worker.errors import (
    AuthError,
    ClientClosed,
    ServerError,
    ServerUnavailable,
    UntrustedCertificate,
)
from diloco.worker.ratelimit import SLICE_BYTES, UploadLimiter
from diloco.worker.retry import RetryPolicy
from diloco.worker.tls import certificate_problem, check_ca_file

Body = bytes | bytearray | memoryview
OnRetry = Callable[[str, BaseException | int, float], None]

RETRIED_STATUSES = frozenset({429, 502, 503, 504})
# Failures of the connection itself; anything else (a TLS certificate error, a bad URL) will
# not heal by waiting, so it ends the call at once.
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ProtocolError,
    Urllib3Timeout,
    ProxyError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)
_READ_CHUNK = 4 * 1024 * 1024
_MAX_WAIT = 120.0  # the server's cap on `wait` for a result long-poll
_MAX_STEPS_PER_SECOND = 1e6  # the server's bound on a heartbeat's speed (422 above it)
_AUTH_TRIES = 2  # 401 to a credential: the same call again with the enrollment token, once


@dataclass(frozen=True)
class ClientStats:
    """A snapshot of the client's counters, for the worker's --json report.

    Bytes count request and response bodies (JSON included, headers not) of every attempt
    that got an answer. `blocked_seconds` is wall time inside client calls, retries and
    backoff sleeps included, from every thread; `blocked_by_operation` splits it per method
    so a worker can leave out the background heartbeat.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    blocked_seconds: float = 0.0
    retries: int = 0
    blocked_by_operation: dict[str, float] = field(default_factory=dict)
    largest_upload: int = 0  # the biggest pseudo-gradient sent: what one sync moves at once


class _Counters:
    """Counters shared by the training thread and the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ClientStats()

    def add(
        self,
        *,
        sent: int = 0,
        received: int = 0,
        retries: int = 0,
        operation: str | None = None,
        blocked: float = 0.0,
        upload: int = 0,
    ) -> None:
        with self._lock:
            s = self._stats
            by_operation = s.blocked_by_operation
            if operation is not None:
                by_operation = dict(by_operation)
                by_operation[operation] = by_operation.get(operation, 0.0) + blocked
            self._stats = ClientStats(
                bytes_sent=s.bytes_sent + sent,
                bytes_received=s.bytes_received + received,
                blocked_seconds=s.blocked_seconds + blocked,
                retries=s.retries + retries,
                blocked_by_operation=by_operation,
                largest_upload=max(s.largest_upload, upload),
            )

    def snapshot(self) -> ClientStats:
        with self._lock:
            return self._stats


@dataclass(frozen=True)
class _Reply:
    """One complete HTTP answer: its body is already read in full."""

    status: int
    headers: Mapping[str, str]
    body: bytearray
    url: str


def _split_base_url(base_url: str) -> tuple[str, str]:
    """Return (origin, path prefix) of an http(s) base URL, or raise ValueError."""
    if not isinstance(base_url, str):
        raise ValueError(f"base_url must be a string, got {base_url!r}")
    parts = urlsplit(base_url.strip())
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    if not parts.hostname:
        raise ValueError(f"base_url has no host: {base_url!r}")
    if parts.username or parts.password:
        raise ValueError(f"base_url must not carry credentials; pass token= instead: {base_url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"base_url must not have a query or fragment: {base_url!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValueError(f"base_url has a bad port: {base_url!r}") from exc
    return f"{parts.scheme.lower()}://{parts.netloc}", parts.path.rstrip("/")


def _read_body(response: urllib3.BaseHTTPResponse, into: bytearray | None = None) -> bytearray:
    """Read a streamed body into one buffer, preallocated when Content-Length is known.

    `into` is used instead of a new buffer when it has exactly Content-Length bytes: a worker
    that downloads the weights every round then writes them over the same memory rather than
    page-faulting a fresh model-sized buffer in each time.
    """
    length = response.headers.get("Content-Length")
    if length is None:
        buffer = bytearray()
        for chunk in response.stream(_READ_CHUNK):
            buffer += chunk
        return buffer
    size = int(length)
    buffer = into if into is not None and len(into) == size else bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        got = response.readinto(view[done : done + _READ_CHUNK])
        if got == 0:
            raise ProtocolError(f"connection closed after {done} of {size} body bytes")
        done += got
    return buffer


def _server_error(reply: _Reply) -> ServerError:
    """Build the protocol's error from a rejection, tolerating bodies that are not JSON."""
    try:
        payload = json.loads(reply.body)
    except ValueError:
        payload = None
    error_class = AuthError if reply.status == 401 else ServerError
    if isinstance(payload, dict) and isinstance(payload.get("kind"), str):
        return error_class(
            reply.status,
            payload["kind"],
            str(payload.get("error", "")),
            payload.get("detail"),
            url=reply.url,
        )
    text = bytes(reply.body[:200]).decode("utf-8", "replace").strip()
    reason = http.client.responses.get(reply.status, "")
    return error_class(reply.status, f"http_{reply.status}", text or reason, None, url=reply.url)


def _json_dict(reply: _Reply) -> dict[str, Any]:
    """The JSON object of a success answer; an empty body reads as {}."""
    if not reply.body:
        return {}
    try:
        payload = json.loads(reply.body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise ServerError(
            reply.status, "invalid_response", "the answer is not a JSON object", url=reply.url
        )
    return payload


def _round_header(reply: _Reply) -> int:
    value = reply.headers.get("X-Diloco-Round")
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ServerError(
            reply.status,
            "invalid_response",
            f"tensor answer without a valid X-Diloco-Round header (got {value!r})",
            url=reply.url,
        ) from None


@dataclass(frozen=True)
class Weights:
    """Global weights as the server sent them, with the rounds its headers state."""

    body: bytearray
    round: int  # what they start: the round (sync), the version (async, streaming)
    fragment_rounds: list[int] | None = None  # streaming: each fragment's round


def _weights(reply: _Reply) -> Weights:
    rounds = reply.headers.get("X-Diloco-Fragment-Rounds")
    fragment_rounds = None
    if rounds:
        try:
            fragment_rounds = [int(r) for r in rounds.split(",")]
        except ValueError:
            raise ServerError(
                reply.status,
                "invalid_response",
                f"X-Diloco-Fragment-Rounds is not a list of integers (got {rounds!r})",
                url=reply.url,
            ) from None
    return Weights(reply.body, _round_header(reply), fragment_rounds)


def _retry_after(reply: _Reply) -> float | None:
    """Seconds from a numeric Retry-After header, if the server sent one."""
    try:
        seconds = float(reply.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class DiLoCoClient:
    """Calls of the coordinator's routes, with retries, timeouts, auth and byte counters.

    Safe to share between threads (the training loop and the heartbeat). `close()`, from any
    thread, also wakes a call that is sleeping between retries; it then raises ClientClosed.
    `sleep`, `clock` and `rng` are for tests.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        auth: BearerAuth | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 300.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 -- frozen, so sharing it is safe
        on_retry: OnRetry | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        max_upload_mbps: float | None = None,
    ) -> None:
        """`max_upload_mbps` paces tensor uploads to that many megabits per second.

        `token` is the enrollment token (None: $DILOCO_TOKEN, if set); `auth` shares another
        client's secrets instead (the worker's heartbeat client). `ca_file`: PEM certificates
        that an https:// server's certificate must chain to (else the system's).
        """
        self._origin, self._prefix = _split_base_url(base_url)
        self._limiter = (
            UploadLimiter.from_mbps(max_upload_mbps) if max_upload_mbps is not None else None
        )
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if auth is not None and token is not None:
            raise ValueError("give token or auth, not both")
        self.auth = auth if auth is not None else BearerAuth(token)
        if ca_file is not None:
            check_ca_file(ca_file)
        self.base_url = self._origin + self._prefix
        self.retry = retry
        self._connect_timeout = float(connect_timeout)
        self._read_timeout = float(read_timeout)
        self._headers = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}  # on every request
        self._on_retry = on_retry
        self._closed = threading.Event()
        self._sleep = sleep if sleep is not None else self._closed.wait
        self._clock = clock
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._counters = _Counters()
        # The last "waiting" answer of a result long-poll: who the round waits for
        # (`waiting_for`, `more_submissions_needed`), for a caller that reports a long wait.
        self.last_waiting: dict[str, Any] = {}
        # Two threads use the client at once; a few spare connections cost nothing.
        tls = {} if ca_file is None else {"ca_certs": os.fspath(ca_file)}
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=4, block=False, retries=False, **tls)

    @property
    def credential(self) -> str | None:
        """This worker's own credential, from its registration (or a checkpoint)."""
        return self.auth.credential

    @credential.setter
    def credential(self, value: str | None) -> None:
        self.auth.credential = value

    # -- counters -----------------------------------------------------------------------------

    @property
    def stats(self) -> ClientStats:
        """A consistent snapshot of every counter at once."""
        return self._counters.snapshot()

    @property
    def bytes_sent(self) -> int:
        return self.stats.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.stats.bytes_received

    @property
    def blocked_seconds(self) -> float:
        return self.stats.blocked_seconds

    @property
    def retries(self) -> int:
        return self.stats.retries

    # -- routes -------------------------------------------------------------------------------

    def healthz(self) -> dict[str, Any]:
        return self._json_call("healthz", "GET", "/healthz")

    def info(self) -> dict[str, Any]:
        return self._json_call("info", "GET", "/v1/info")

    def register(
        self,
        worker_id: str | None,
        tensors: list[dict[str, Any]],
        protocol_version: int = PROTOCOL_VERSION,
        *,
        session: str | None = None,
    ) -> dict[str, Any]:
        """Register; with a `session`, a retry whose first answer was lost is answered again."""
        payload: dict[str, Any] = {
            "protocol_version": protocol_version,
            "worker_id": worker_id,
            "tensors": tensors,
        }
        if session is not None:
            payload["session"] = session
        answer = self._json_call("register", "POST", "/v1/workers", payload=payload)
        if answer.get("credential"):  # none from an open server
            self.auth.credential = answer["credential"]
        return answer

    def upload_initial(self, worker_id: str, body: Body) -> dict[str, Any]:
        """Offer the first global weights; {"status": "exists"} when another worker won."""
        reply = self._call(
            "upload_initial",
            "PUT",
            "/v1/weights/initial",
            query={"worker_id": worker_id},
            body=body,
            content_type="application/octet-stream",
        )
        if reply.status == 409:
            error = _server_error(reply)
            if error.kind == "weights_exist":
                return {"status": "exists"}
            raise error
        return _json_dict(self._success(reply))

    def get_weights(self, into: bytearray | None = None) -> tuple[bytearray, int]:
        """The current global weights (safetensors bytes) and the round they start.

        With `into`, a buffer of the right size is overwritten with the weights and returned
        (see `wait_result`).
        """
        weights = self.get_weights_detail(into=into)
        return weights.body, weights.round

    def get_weights_detail(self, into: bytearray | None = None) -> Weights:
        """The current global weights with every round header (streaming: per fragment)."""
        reply = self._success(self._call("get_weights", "GET", "/v1/weights", into=into))
        return _weights(reply)

    def submit(
        self,
        round: int,
        worker_id: str,
        body: Body,
        *,
        fragment: int = 0,
        tokens: int = 0,
        units: Sequence[int] = (),
        progress: Mapping[int, int] | None = None,
    ) -> dict[str, Any]:
        """Send one pseudo-gradient; a retry of the same (worker, round, fragment) counts once.

        `units`: ids of the work units finished since the last submission; they complete when
        this round commits. `progress`: units trained in part, unit -> samples of it trained
        so far; the round records that prefix, and the rest is all that is ever leased again.
        """
        query: dict[str, Any] = {"worker_id": worker_id, "fragment": fragment, "tokens": tokens}
        reports = [str(int(u)) for u in units]
        reports += [f"{int(u)}:{int(n)}" for u, n in (progress or {}).items()]
        if reports:
            query["units"] = ",".join(reports)
        reply = self._call(
            "submit",
            "POST",
            f"/v1/rounds/{int(round)}/submissions",
            query=query,
            body=body,
            content_type="application/octet-stream",
        )
        answer = _json_dict(self._success(reply))
        self._counters.add(upload=memoryview(body).nbytes)
        return answer

    def wait_result(
        self,
        round: int,
        worker_id: str,
        wait: float = 30.0,
        *,
        fragment: int = 0,
        into: bytearray | None = None,
    ) -> tuple[bytearray, int] | None:
        """Long-poll round `round`'s result: (weights, next round), or None while it is open.

        In streaming mode `fragment` names the fragment whose round this is, and the weights
        are that fragment's tensors; in async mode `round` is the version the arrival was for.
        With `into` (the buffer the last weights came in, once they have been loaded), weights
        of the same size are read into it and it is returned; its old content is then gone,
        even when the call fails part way. Otherwise a new buffer is allocated.
        """
        if not (math.isfinite(wait) and 0 <= wait <= _MAX_WAIT):
            raise ValueError(f"wait must be in [0, {_MAX_WAIT:g}] seconds, got {wait!r}")
        query = {"worker_id": worker_id, "wait": f"{wait:g}"}
        if fragment:
            query["fragment"] = str(int(fragment))
        reply = self._call(
            "wait_result",
            "GET",
            f"/v1/rounds/{int(round)}/result",
            query=query,
            # The server holds the answer for `wait`, and may then still be committing the
            # round (a durable checkpoint), so the usual read timeout comes on top.
            read_timeout=wait + self._read_timeout,
            into=into,
        )
        if reply.status == 202:
            try:
                waiting = json.loads(reply.body)
            except ValueError:
                waiting = None
            self.last_waiting = waiting if isinstance(waiting, dict) else {}
            return None
        reply = self._success(reply)
        return reply.body, _round_header(reply)

    def register_dataset(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict[str, Any]:
        """State the dataset this worker trains (idempotent for the same shape)."""
        return self._json_call(
            "register_dataset",
            "POST",
            "/v1/datasets",
            payload={
                "worker_id": worker_id,
                "dataset_id": dataset_id,
                "length": length,
                "shuffle_seed": shuffle_seed,
                "unit_size": unit_size,
            },
        )

    def lease(
        self, worker_id: str, dataset_id: str, count: int = 1, next_epoch: bool = False
    ) -> dict[str, Any]:
        """Lease work units: `status` "leased" with `units`, or "exhausted" for this epoch.

        Every retry of this call carries one random key, so a lost answer is replayed rather
        than leasing other units.
        """
        return self._json_call(
            "lease",
            "POST",
            f"/v1/datasets/{quote(dataset_id, safe='')}/leases",
            payload={
                "worker_id": worker_id,
                "count": count,
                "next_epoch": next_epoch,
                "lease_key": secrets.token_hex(12),
            },
        )

    def leases(self, worker_id: str, dataset_id: str) -> dict[str, Any]:
        """The units of `dataset_id` leased to `worker_id` now, each with the samples still to
        train (after a resume, the truth about what the rounds since the checkpoint trained)."""
        return self._json_call(
            "leases",
            "GET",
            f"/v1/datasets/{quote(dataset_id, safe='')}/leases",
            query={"worker_id": worker_id},
        )

    def heartbeat(
        self,
        worker_id: str,
        step: int,
        steps_per_second: float,
        loss: float | None,
        tokens: int,
        windows: int | None = None,
    ) -> dict[str, Any]:
        """A sign of life; `windows` (sync windows finished) makes `steps_per_second` that
        window's compute speed, which the server's DyLU smooths into a recommended H."""
        # JSON has no NaN: a diverged loss is reported as unknown rather than failing the beat.
        if loss is not None and not math.isfinite(loss):
            loss = None
        if not math.isfinite(steps_per_second) or steps_per_second < 0:
            steps_per_second = 0.0
        steps_per_second = min(steps_per_second, _MAX_STEPS_PER_SECOND)
        payload: dict[str, Any] = {
            "step": step,
            "steps_per_second": steps_per_second,
            "loss": loss,
            "tokens": tokens,
        }
        if windows is not None:
            payload["windows"] = windows
        path = f"/v1/workers/{quote(worker_id, safe='')}/heartbeat"
        return self._json_call("heartbeat", "POST", path, payload=payload)

    def deregister(self, worker_id: str) -> dict[str, Any]:
        return self._json_call("deregister", "DELETE", f"/v1/workers/{quote(worker_id, safe='')}")

    def status(self) -> dict[str, Any]:
        return self._json_call("status", "GET", "/v1/status")

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections; a call sleeping between retries wakes and raises."""
        self._closed.set()
        self._pool.clear()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> DiLoCoClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- machinery ----------------------------------------------------------------------------

    def _json_call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        payload: Any = None,
        query: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = None
        if payload is not None:
            body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode()
        content_type = "application/json" if body is not None else None
        reply = self._call(
            operation, method, path, query=query, body=body, content_type=content_type
        )
        return _json_dict(self._success(reply))

    @staticmethod
    def _success(reply: _Reply) -> _Reply:
        if 200 <= reply.status < 300:
            return reply
        raise _server_error(reply)

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self._origin + self._prefix + path
        return f"{url}?{urlencode(query)}" if query else url

    def _call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Body | None = None,
        content_type: str | None = None,
        read_timeout: float | None = None,
        into: bytearray | None = None,
    ) -> _Reply:
        """Send one request until it gets an answer that retrying cannot change.

        Returns any answer but 401 (AuthError) and the retried statuses; raises
        ServerUnavailable once the RetryPolicy is spent, ClientClosed after close().
        """
        self._check_open()
        url = self._url(path, query)
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        timeout = urllib3.Timeout(
            connect=self._connect_timeout,
            read=self._read_timeout if read_timeout is None else read_timeout,
        )
        with self._rng_lock:
            rng = random.Random(self._rng.getrandbits(64))
        delays = self.retry.delays(rng)
        started = self._clock()
        attempts = 0
        auth_tries = 0
        try:
            while True:
                attempts += 1
                retry_after = None
                secret = self.auth.secret()
                if secret:
                    headers["Authorization"] = f"Bearer {secret}"
                else:
                    headers.pop("Authorization", None)
                try:
                    reply = self._attempt(method, url, body, headers, timeout, into)
                except _TRANSIENT_ERRORS as exc:
                    cause: BaseException = exc
                    signal: BaseException | int = exc
                except urllib3.exceptions.SSLError as exc:
                    why = certificate_problem(exc)
                    if why is not None:
                        raise UntrustedCertificate(url, exc, attempts=attempts, why=why) from None
                    reason = f"TLS handshake failed; is the server serving https? ({exc})"
                    raise ServerUnavailable(url, exc, attempts=attempts, reason=reason) from None
                except urllib3.exceptions.HTTPError as exc:
                    raise ServerUnavailable(url, exc, attempts=attempts, reason="fatal") from exc
                else:
                    if reply.status == 401:
                        auth_tries += 1
                        if auth_tries < _AUTH_TRIES and self.auth.refused(secret):
                            continue  # at once, with the secret that replaces the refused one
                        raise _server_error(reply)
                    if reply.status not in RETRIED_STATUSES:
                        return reply
                    cause, signal = _server_error(reply), reply.status
                    retry_after = _retry_after(reply)
                delay = next(delays, None)
                if delay is None:
                    raise ServerUnavailable(
                        url, cause, attempts=attempts, reason="retries exhausted"
                    ) from cause
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.retry.max_delay))
                deadline = self.retry.deadline
                if deadline is not None and self._clock() - started + delay > deadline:
                    raise ServerUnavailable(
                        url, cause, attempts=attempts, reason=f"deadline of {deadline:g} s"
                    ) from cause
                self._counters.add(retries=1)
                if self._on_retry is not None:
                    self._on_retry(operation, signal, delay)
                self._sleep(delay)
                self._check_open()
        finally:
            self._counters.add(operation=operation, blocked=self._clock() - started)

    def _attempt(
        self,
        method: str,
        url: str,
        body: Body | None,
        headers: Mapping[str, str],
        timeout: urllib3.Timeout,
        into: bytearray | None = None,
    ) -> _Reply:
        payload: Any = body
        if self._limiter is not None and body is not None and len(body) > SLICE_BYTES:
            headers = {**headers, "Content-Length": str(memoryview(body).nbytes)}
            payload = self._limiter.paced(body)
        response = self._pool.urlopen(
            method,
            url,
            body=payload,
            headers=headers,
            timeout=timeout,
            retries=False,
            redirect=False,
            preload_content=False,
        )
        try:
            # Only a success carries the weights; an error's JSON never lands in `into`.
            received = _read_body(response, into if response.status == 200 else None)
        except BaseException:
            response.close()  # a half-read connection must not go back to the pool
            raise
        finally:
            response.release_conn()
        sent = 0 if body is None else memoryview(body).nbytes
        self._counters.add(sent=sent, received=len(received))
        return _Reply(response.status, response.headers, received, url)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ClientClosed(f"the client for {self.base_url} is closed")
