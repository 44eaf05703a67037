"""The worker's HTTP transport: one urllib3 pool, retries with backoff, byte counters.

It moves bytes and knows no route: a request goes out until it gets an answer that retrying
cannot change. Transport failures, 429, 502, 503 and 504 (the server's own `barrier_timeout`
included) are retried under a RetryPolicy, re-sending the very same body: the server
deduplicates by (worker, round, fragment), so a resubmission is safe and a worker never loses
its progress to a dropped connection. What the routes mean is `client.py`'s job.

urllib3 is used because it uploads a bytes body and streams a download at loopback speed
(docs: DESIGN.md); bodies go out as one buffer and come back into one preallocated buffer.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    NameResolutionError,
    ProtocolError,
    ProxyError,
    ReadTimeoutError,
)
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from diloco.wire.validation import PROTOCOL_HEADER, PROTOCOL_VERSION
from diloco.worker.errors import (
    AuthError,
    ClientClosed,
    ServerError,
    ServerUnavailable,
    ServerUnreachable,
    UntrustedCertificate,
)
from diloco.worker.net.auth import BearerAuth
from diloco.worker.net.ratelimit import SLICE_BYTES, UploadLimiter
from diloco.worker.net.retry import RetryPolicy
from diloco.worker.net.tls import (
    certificate_problem,
    check_ca_file,
    exception_chain,
    speaks_tls,
)

Body = bytes | bytearray | memoryview
OnRetry = Callable[[str, BaseException | int, float], None]
# (operation, retries, seconds): a call that had to be retried got its answer at last
OnRecovered = Callable[[str, int, float], None]

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
_DROPPED = "the connection was closed without an HTTP answer"
_TLS_PROBE_SECONDS = 5.0  # the most a TLS handshake may take to tell an https:// server
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
    # wall time reading response bodies once their headers came: the download part of a call
    body_seconds: float = 0.0


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
        body_seconds: float = 0.0,
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
                body_seconds=s.body_seconds + body_seconds,
            )

    def snapshot(self) -> ClientStats:
        with self._lock:
            return self._stats


@dataclass(frozen=True)
class Reply:
    """One complete HTTP answer: its body is already read in full."""

    status: int
    headers: Mapping[str, str]
    body: bytearray
    url: str


def split_base_url(base_url: str) -> tuple[str, str]:
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


def read_body(response: urllib3.BaseHTTPResponse, into: bytearray | None = None) -> bytearray:
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


def connection_failure(exc: BaseException) -> str:
    """Why a request got no HTTP answer, in a few words for a user ("connection refused")."""
    if isinstance(exc, NameResolutionError):
        return "the host name does not resolve"
    if isinstance(exc, ReadTimeoutError):
        return "no answer within the read timeout"
    chain = list(exception_chain(exc))
    if any(isinstance(error, ConnectionRefusedError) for error in chain):
        return "connection refused"
    # http.client.RemoteDisconnected is a ConnectionResetError
    if any(isinstance(error, (ConnectionResetError, ConnectionAbortedError)) for error in chain):
        return _DROPPED
    for error in chain:  # urllib3's NewConnectionError is a ConnectTimeoutError: look under it
        if isinstance(error, OSError) and error.strerror:
            return error.strerror[:1].lower() + error.strerror[1:]
    if any(isinstance(error, (TimeoutError, ConnectTimeoutError)) for error in chain):
        return "the connection timed out"
    return type(exc).__name__


def server_error(reply: Reply) -> ServerError:
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


def success(reply: Reply) -> Reply:
    """The reply itself if it is a 2xx, else its ServerError raised."""
    if 200 <= reply.status < 300:
        return reply
    raise server_error(reply)


def _retry_after(reply: Reply) -> float | None:
    """Seconds from a numeric Retry-After header, if the server sent one."""
    try:
        seconds = float(reply.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def request_headers() -> dict[str, str]:
    """The headers every request carries: the protocol version (the credential is added per
    attempt by `Transport.call`, from its `BearerAuth`)."""
    return {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}


def connection_pool(
    ca_file: str | os.PathLike[str] | None = None, send_timeout: float = 300.0
) -> urllib3.PoolManager:
    """The pool every request of one client goes through; `ca_file` (PEM) is what an https://
    server's certificate must chain to (else the system's).

    Two threads use a client at once (training and a streaming sync); a few spare connections
    cost nothing. urllib3's own retries and redirects are off: `Transport.call` decides.

    urllib3 sends a request's body under the connect timeout, and in one `sendall`, whose
    timeout bounds the whole call: any upload that took more than 10 s (a 1.4 GB one at 350M
    parameters behind a busy server; an 85M model's 342 MB at 100 Mbit/s) was cut off and
    sent again from its first byte. Here a connection is made within the connect timeout,
    then sends its body a slice of SEND_SLICE bytes at a time, each under `send_timeout`
    (the client's read timeout): that bounds a pause in which the server takes nothing, not
    the upload.
    """
    if ca_file is not None:
        check_ca_file(ca_file)
    tls = {} if ca_file is None else {"ca_certs": os.fspath(ca_file)}
    manager = urllib3.PoolManager(num_pools=2, maxsize=4, block=False, retries=False, **tls)
    manager.pool_classes_by_scheme = {
        scheme: type(
            f"Patient{pool.__name__}",
            (pool,),
            {"ConnectionCls": _patient(pool.ConnectionCls, send_timeout)},
        )
        for scheme, pool in manager.pool_classes_by_scheme.items()
    }
    return manager


SEND_SLICE = 1 << 20  # bytes per sendall of a body: `send_timeout` bounds each


def _patient(connection: type, send_timeout: float) -> type:
    """`connection` that sends under `send_timeout` once connected, a slice at a time (see
    connection_pool). Every byte of a request, headers and body, goes through `send`."""

    def send(self: Any, data: Any) -> None:
        if self.sock is None:  # as http.client's send would: within the connect timeout
            self.connect()
        self.sock.settimeout(send_timeout)  # (urllib3 left the connect timeout on it)
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data)
            if view.nbytes > SEND_SLICE and view.c_contiguous:
                view = view.cast("B")
                for start in range(0, view.nbytes, SEND_SLICE):
                    connection.send(self, view[start : start + SEND_SLICE])
                return
        connection.send(self, data)

    return type(
        f"Patient{connection.__name__}",
        (connection,),
        {"send": send},
    )


class Transport:
    """Requests to one server with retries, timeouts and byte counters; safe between threads.

    `close()`, from any thread, also wakes a call that is sleeping between retries; it then
    raises ClientClosed. `sleep`, `clock` and `rng` are for tests.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 300.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 -- frozen, so sharing it is safe
        on_retry: OnRetry | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        max_upload_mbps: float | None = None,
        auth: BearerAuth | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        on_recovered: OnRecovered | None = None,
    ) -> None:
        """`max_upload_mbps` paces tensor uploads to that many megabits per second.
        `on_retry` hears of each retry before its wait, `on_recovered` of a retried call's
        answer (both from the calling thread).

        `token` is the enrollment token (None: $DILOCO_TOKEN, if set); `auth` shares another
        client's secrets instead (the worker's heartbeat client). `ca_file`: PEM certificates
        that an https:// server's certificate must chain to (else the system's).
        """
        if auth is not None and token is not None:
            raise ValueError("give token or auth, not both")
        self.auth = auth if auth is not None else BearerAuth(token)
        self._origin, self._prefix = split_base_url(base_url)
        self._limiter = (
            UploadLimiter.from_mbps(max_upload_mbps) if max_upload_mbps is not None else None
        )
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        self._headers = request_headers()
        self.base_url = self._origin + self._prefix
        self.retry = retry
        self.read_timeout = float(read_timeout)
        self._connect_timeout = float(connect_timeout)
        self._on_retry = on_retry
        self._on_recovered = on_recovered
        self._closed = threading.Event()
        self._sleep = sleep if sleep is not None else self._closed.wait
        self._clock = clock
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._counters = _Counters()
        self._pool = connection_pool(ca_file, send_timeout=self.read_timeout)
        # Until the server first answers, a failed connection may be a wrong URL: see
        # RetryPolicy.first_contact and _refuse_a_tls_port.
        self._answered = False
        self._tls_probed = False

    @property
    def stats(self) -> ClientStats:
        """A consistent snapshot of every counter at once."""
        return self._counters.snapshot()

    def count_upload(self, nbytes: int) -> None:
        """A pseudo-gradient of `nbytes` went out (the largest is reported)."""
        self._counters.add(upload=nbytes)

    def close(self) -> None:
        """Close the connections; a call sleeping between retries wakes and raises."""
        self._closed.set()
        self._pool.clear()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def call(
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
    ) -> Reply:
        """Send one request until it gets an answer that retrying cannot change.

        Returns any answer but 401 (AuthError) and the retried statuses; raises
        ServerUnavailable once the RetryPolicy is spent (ServerUnreachable while the server has
        never answered this client), ClientClosed after close().
        """
        self._check_open()
        url = self._url(path, query)
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        timeout = urllib3.Timeout(
            connect=self._connect_timeout,
            read=self.read_timeout if read_timeout is None else read_timeout,
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
                    if not self._answered:
                        self._refuse_a_tls_port(url, exc, attempts)
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
                        raise server_error(reply)
                    if reply.status not in RETRIED_STATUSES:
                        if attempts > 1 + auth_tries and self._on_recovered is not None:
                            self._on_recovered(
                                operation, attempts - 1 - auth_tries, self._clock() - started
                            )
                        return reply
                    cause, signal = server_error(reply), reply.status
                    retry_after = _retry_after(reply)
                delay = next(delays, None)
                if not self._answered:
                    delay = self._wait_for_a_first_answer(
                        url, cause, attempts, self._clock() - started, delay
                    )
                if delay is None:
                    raise ServerUnavailable(
                        url, cause, attempts=attempts, reason="retries exhausted"
                    ) from cause
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.retry.max_delay))
                deadline = self.retry.deadline if self._answered else None  # else: just above
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

    def _wait_for_a_first_answer(
        self,
        url: str,
        cause: BaseException,
        attempts: int,
        elapsed: float,
        delay: float | None,
    ) -> float:
        """The wait before the next try while the server has never answered (cut so that the
        last try falls on RetryPolicy.first_contact or the deadline), or ServerUnreachable."""
        limits = [s for s in (self.retry.first_contact, self.retry.deadline) if s is not None]
        limit = min(limits) if limits else None
        left = None if limit is None else limit - elapsed
        if delay is None or (left is not None and left <= 0):
            raise ServerUnreachable(
                url,
                cause,
                server=self.base_url,
                attempts=attempts,
                why=connection_failure(cause),
                seconds=None if delay is None else limit,
            ) from cause
        return delay if left is None else min(delay, left)

    def _refuse_a_tls_port(self, url: str, exc: BaseException, attempts: int) -> None:
        """ServerUnreachable naming the https:// URL when an http:// request was dropped
        unanswered by a port that completes a TLS handshake (a TLS server drops plain HTTP).
        Probed once per client, and only before the server's first answer."""
        if self._tls_probed or not self._origin.startswith("http://"):
            return
        if connection_failure(exc) != _DROPPED:
            return
        self._tls_probed = True
        parts = urlsplit(self._origin)
        assert parts.hostname is not None  # split_base_url checked it
        timeout = min(self._connect_timeout, _TLS_PROBE_SECONDS)
        if speaks_tls(parts.hostname, parts.port or 80, timeout):
            raise ServerUnreachable(
                url,
                exc,
                server=self.base_url,
                attempts=attempts,
                why="it speaks TLS",
                https_url="https://" + self.base_url.removeprefix("http://"),
            ) from None

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self._origin + self._prefix + path
        return f"{url}?{urlencode(query)}" if query else url

    def _attempt(
        self,
        method: str,
        url: str,
        body: Body | None,
        headers: Mapping[str, str],
        timeout: urllib3.Timeout,
        into: bytearray | None = None,
    ) -> Reply:
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
        self._answered = True
        reading = self._clock()
        try:
            # Only a success carries the weights; an error's JSON never lands in `into`.
            received = read_body(response, into if response.status == 200 else None)
        except BaseException:
            response.close()  # a half-read connection must not go back to the pool
            raise
        finally:
            response.release_conn()
        sent = 0 if body is None else memoryview(body).nbytes
        self._counters.add(sent=sent, received=len(received), body_seconds=self._clock() - reading)
        return Reply(response.status, response.headers, received, url)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ClientClosed(f"the client for {self.base_url} is closed")
