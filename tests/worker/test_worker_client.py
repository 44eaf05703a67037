"""DiLoCoClient against small scripted HTTP servers on 127.0.0.1 (the real server is separate).

Each test scripts the server's answers (a reply, a connection reset, a dropped connection, a
truncated body, a stall) and checks what the client sent, what it returned, and what it raised.
"""

from __future__ import annotations

import json
import math
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from urllib3.exceptions import NewConnectionError, ProtocolError, ReadTimeoutError

from diloco.worker import (
    AuthError,
    ClientClosed,
    DiLoCoClient,
    RetryPolicy,
    ServerError,
    ServerUnavailable,
    ServerUnreachable,
)
from diloco.worker.net.client import Weights

# -- the scripted server ----------------------------------------------------------------------

RESET = "reset"  # read the request, then abort the connection with an RST
DROP = "drop"  # read the request, then close the connection without answering


@dataclass(frozen=True)
class Reply:
    status: int = 200
    json: Any = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    stall: float = 0.0  # seconds to wait before answering
    truncate: int | None = None  # send only this many body bytes, then close


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class FakeServer:
    """Records every request and answers from a script, then with `fallback`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[Seen] = []
        self.fallback: Reply | str = Reply(200, json={})
        # a large body is read in body_pauses + 1 parts, body_stall seconds between them
        self.body_stall = 0.0
        self.body_pauses = 1
        self._script: deque[Reply | str] = deque()
        self._lock = threading.Lock()

    def script(self, *actions: Reply | str) -> None:
        with self._lock:
            self._script.extend(actions)

    def take(self, request: Seen) -> Reply | str:
        with self._lock:
            self.seen.append(request)
            return self._script.popleft() if self._script else self.fallback


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_GET

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        fake = self.server.fake  # type: ignore[attr-defined]
        if fake.body_stall and length > 1024 * 1024:  # a busy server that reads nothing a while
            part = length // (fake.body_pauses + 1)
            body = b""
            for _ in range(fake.body_pauses):
                body += self.rfile.read(part)
                time.sleep(fake.body_stall)
            body += self.rfile.read(length - len(body))
        else:
            body = self.rfile.read(length)
        parts = urlsplit(self.path)
        seen = Seen(
            self.command,
            parts.path,
            dict(parse_qsl(parts.query)),
            {k.lower(): v for k, v in self.headers.items()},
            body,
        )
        action = self.server.fake.take(seen)  # type: ignore[attr-defined]
        if action in (RESET, DROP):
            if action == RESET:
                linger = struct.pack("ii", 1, 0)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            self.close_connection = True
            return
        assert isinstance(action, Reply)
        time.sleep(action.stall)
        data = json.dumps(action.json).encode() if action.json is not None else action.body
        self.send_response(action.status)
        if action.json is not None:
            self.send_header("Content-Type", "application/json")
        for name, value in action.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if action.truncate is not None:
            self.wfile.write(data[: action.truncate])
            self.close_connection = True
            return
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    fake = FakeServer(f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.fake = fake  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    yield fake
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


class FakeTime:
    """A clock that only moves when the client sleeps, so waits are exact and instant."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


FAST = RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.05, jitter=0.0)


def make_client(
    server: FakeServer, fake_time: FakeTime | None = None, **kwargs: Any
) -> DiLoCoClient:
    fake_time = fake_time or FakeTime()
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("connect_timeout", 2.0)
    kwargs.setdefault("read_timeout", 5.0)
    return DiLoCoClient(
        server.url, sleep=fake_time.sleep, clock=fake_time.clock, rng=random.Random(0), **kwargs
    )


def recorder() -> tuple[list[tuple[str, BaseException | int, float]], Callable[..., None]]:
    calls: list[tuple[str, BaseException | int, float]] = []
    return calls, lambda operation, cause, delay: calls.append((operation, cause, delay))


ACCEPTED = {"status": "accepted", "round": 3, "current_round": 3, "waiting_for": ["w1"]}


# -- retries resend the same request ----------------------------------------------------------


def test_submit_after_resets_and_drops_resends_the_identical_body(server: FakeServer) -> None:
    server.script(RESET, DROP, Reply(200, json=ACCEPTED))
    calls, on_retry = recorder()
    payload = bytearray(random.Random(1).randbytes(256 * 1024))
    with make_client(server, on_retry=on_retry) as client:
        result = client.submit(3, "w0", payload, fragment=1, tokens=4096)
        assert result == ACCEPTED
        assert client.retries == 2
    assert len(server.seen) == 3
    for seen in server.seen:
        assert (seen.method, seen.path) == ("POST", "/v1/rounds/3/submissions")
        assert seen.query == {"worker_id": "w0", "fragment": "1", "tokens": "4096"}
        assert seen.headers["content-type"] == "application/octet-stream"
        assert seen.headers["x-diloco-protocol"] == "1"  # the protocol, on every request
        assert seen.body == payload
    assert [op for op, _, _ in calls] == ["submit", "submit"]
    assert all(isinstance(cause, (ProtocolError, ConnectionError)) for _, cause, _ in calls)


def test_busy_and_timed_out_answers_are_retried_until_the_result(server: FakeServer) -> None:
    weights = b"safetensors-bytes" * 100
    barrier = {"error": "barrier timed out", "kind": "barrier_timeout", "detail": {"round": 7}}
    server.script(
        Reply(503, body=b"<html>busy</html>"),
        Reply(502, body=b"bad gateway"),
        Reply(504, json=barrier),
        Reply(429, json={"error": "slow down", "kind": "rate_limited", "detail": {}}),
        Reply(200, body=weights, headers={"X-Diloco-Round": "8"}),
    )
    calls, on_retry = recorder()
    with make_client(server, on_retry=on_retry, retry=RetryPolicy(attempts=6, base_delay=0)) as c:
        assert c.wait_result(7, "w1", wait=5) == Weights(bytearray(weights), 8)
    assert [cause for _, cause, _ in calls] == [503, 502, 504, 429]
    assert {(s.path, tuple(s.query.items())) for s in server.seen} == {
        ("/v1/rounds/7/result", (("worker_id", "w1"), ("wait", "5")))
    }


def test_retry_after_is_honoured_up_to_max_delay(server: FakeServer) -> None:
    server.script(
        Reply(429, headers={"Retry-After": "1.5"}),
        Reply(503, headers={"Retry-After": "100"}),
        Reply(200, json={"round": 0}),
    )
    fake_time = FakeTime()
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=2.0, jitter=0.0)
    with make_client(server, fake_time, retry=policy) as client:
        assert client.status() == {"round": 0}
    assert fake_time.sleeps == [1.5, 2.0]


def test_backoff_grows_exponentially_within_jitter_and_max_delay(server: FakeServer) -> None:
    policy = RetryPolicy(attempts=10, base_delay=0.1, max_delay=0.5, jitter=0.5)
    ceilings = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    runs = []
    for _ in range(2):
        server.script(*[Reply(503)] * len(ceilings), Reply(200, json={"ok": True}))
        fake_time = FakeTime()
        with make_client(server, fake_time, retry=policy) as client:
            assert client.healthz() == {"ok": True}
        for wait, ceiling in zip(fake_time.sleeps, ceilings, strict=True):
            assert ceiling * 0.5 <= wait <= ceiling
        runs.append(fake_time.sleeps)
    assert runs[0] == runs[1]  # the injected rng makes the jitter reproducible


# -- rejections are not retried ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "detail"),
    [
        (400, "protocol_version", {"expected": 1, "got": 2}),
        (404, "unknown_worker", {"worker_id": "w0"}),
        (409, "future_round", {"current_round": 2}),
        (422, "wrong_shape", {"tensor": "head.weight", "expected": [4, 2], "got": [2, 4]}),
    ],
)
def test_rejections_raise_server_error_at_once(
    server: FakeServer, status: int, kind: str, detail: dict
) -> None:
    server.script(
        Reply(status, json={"error": f"the {kind} sentence", "kind": kind, "detail": detail})
    )
    with make_client(server) as client:
        with pytest.raises(ServerError) as caught:
            client.submit(3, "w0", b"x", fragment=0, tokens=1)
        assert client.retries == 0
    error = caught.value
    assert (error.status, error.kind, error.error, error.detail) == (
        status,
        kind,
        f"the {kind} sentence",
        detail,
    )
    assert not isinstance(error, AuthError)
    assert len(server.seen) == 1


def test_a_body_that_is_not_json_gives_kind_http_status(server: FakeServer) -> None:
    server.script(Reply(500, body=b"Internal Server Error"))
    with make_client(server) as client, pytest.raises(ServerError) as caught:
        client.info()
    assert (caught.value.status, caught.value.kind) == (500, "http_500")
    assert "Internal Server Error" in caught.value.error
    assert len(server.seen) == 1


def test_401_raises_auth_error_and_is_never_retried(server: FakeServer) -> None:
    body = {"error": "missing or wrong bearer token", "kind": "unauthorized", "detail": {}}
    server.fallback = Reply(401, json=body, headers={"WWW-Authenticate": 'Bearer realm="diloco"'})
    with make_client(server, token="wrong") as client, pytest.raises(AuthError) as caught:
        client.info()
    assert caught.value.kind == "unauthorized"
    assert len(server.seen) == 1


def test_upload_initial_reads_weights_exist_as_a_normal_race(server: FakeServer) -> None:
    exists = {"error": "weights exist", "kind": "weights_exist", "detail": {"initial_from": "w9"}}
    taken = {"error": "id taken", "kind": "worker_id_taken", "detail": {}}
    server.script(
        Reply(200, json={"status": "stored"}), Reply(409, json=exists), Reply(409, json=taken)
    )
    with make_client(server) as client:
        assert client.upload_initial("w0", b"weights") == {"status": "stored"}
        assert client.upload_initial("w0", b"weights") == {"status": "exists", "initial_from": "w9"}
        with pytest.raises(ServerError, match="worker_id_taken"):
            client.upload_initial("w0", b"weights")
    seen = server.seen[0]
    assert (seen.method, seen.path, seen.query, seen.body) == (
        "PUT",
        "/v1/weights/initial",
        {"worker_id": "w0"},
        b"weights",
    )


# -- giving up --------------------------------------------------------------------------------


def test_exhausted_attempts_raise_server_unavailable_naming_the_url(server: FakeServer) -> None:
    server.fallback = Reply(503, body=b"down")
    client = make_client(server, retry=RetryPolicy(attempts=3, base_delay=0))
    with client, pytest.raises(ServerUnavailable) as caught:
        client.status()
    error = caught.value
    assert error.url == f"{server.url}/v1/status"
    assert error.url in str(error)
    assert error.attempts == 3
    assert isinstance(error.cause, ServerError) and error.cause.status == 503
    assert len(server.seen) == 3


def test_an_unreachable_server_reports_the_transport_cause() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    fake_time = FakeTime()
    policy = RetryPolicy(attempts=2, base_delay=0)
    client = DiLoCoClient(url, retry=policy, connect_timeout=1.0, sleep=fake_time.sleep)
    with client, pytest.raises(ServerUnreachable) as caught:
        client.get_weights()
    assert caught.value.url == f"{url}/v1/weights"
    assert str(caught.value) == (
        f"no diloco server answered at {url} (connection refused) in 2 tries: is it running? "
        "check the URL"
    )
    assert isinstance(caught.value.cause, NewConnectionError)
    assert caught.value.attempts == 2


def closed_url() -> str:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_first_contact_ends_retries_of_a_server_that_never_answered_on_time() -> None:
    url, fake_time = closed_url(), FakeTime()
    policy = RetryPolicy(base_delay=1.0, max_delay=100.0, jitter=0.0, first_contact=3.5)
    client = DiLoCoClient(url, retry=policy, sleep=fake_time.sleep, clock=fake_time.clock)
    with client, pytest.raises(ServerUnreachable) as caught:
        client.info()
    assert fake_time.sleeps == [1.0, 2.0, 0.5]  # the last wait is cut: a last try at 3.5 s
    assert caught.value.attempts == 4 and caught.value.seconds == 3.5
    assert caught.value.message("--server") == (
        f"no diloco server answered at {url} (connection refused) for 3.5 s: is it running? "
        "check --server"
    )


def test_a_server_that_answered_once_is_retried_past_first_contact(server: FakeServer) -> None:
    """A restart of a server the client has reached is waited out, as without first_contact."""
    fake_time = FakeTime()
    policy = RetryPolicy(base_delay=1.0, max_delay=1.0, jitter=0.0, first_contact=0.5)
    with make_client(server, fake_time, retry=policy) as client:
        client.info()
        server.script(*[DROP] * 4, RESET, Reply(200, json={"status": "ok"}))
        assert client.healthz() == {"status": "ok"}
    assert fake_time.sleeps == [1.0] * 5


def test_a_dropped_plain_http_request_to_a_server_that_is_not_tls_is_retried(
    server: FakeServer,
) -> None:
    """A drop before the first answer may be a TLS port: the probe finds plain HTTP here."""
    server.script(DROP, Reply(200, json={}))
    with make_client(server) as client:
        assert client.info() == {}
    assert [seen.path for seen in server.seen] == ["/v1/info", "/v1/info"]


def test_the_deadline_stops_retries_whose_wait_would_pass_it(server: FakeServer) -> None:
    server.fallback = Reply(503)
    fake_time = FakeTime()
    policy = RetryPolicy(attempts=None, base_delay=1.0, max_delay=100.0, jitter=0.0, deadline=10.0)
    client = make_client(server, fake_time, retry=policy)
    with client, pytest.raises(ServerUnavailable, match="deadline"):
        client.status()
    assert fake_time.sleeps == [1.0, 2.0, 4.0]  # a wait of 8 would end at 15 s > 10 s
    assert len(server.seen) == 4


def test_a_read_timeout_is_retried_then_reported(server: FakeServer) -> None:
    server.fallback = Reply(200, json={}, stall=1.0)
    client = make_client(server, read_timeout=0.2, retry=RetryPolicy(attempts=2, base_delay=0))
    with client, pytest.raises(ServerUnavailable) as caught:
        client.info()
    assert isinstance(caught.value.cause, ReadTimeoutError)
    assert len(server.seen) == 2


# -- bodies and counters ----------------------------------------------------------------------


@pytest.mark.parametrize("connection", ["new", "kept alive"])
def test_a_server_that_stops_reading_an_upload_for_a_while_is_waited_for(
    server: FakeServer, connection: str
) -> None:
    """A busy server takes no bytes of a large body for longer than the connect timeout (at
    350M parameters a worker's 1.4 GB upload was cut off so, after 10 s, and sent again in
    full): the send waits up to the read timeout instead, and the body goes once, whole; on
    a new connection and on one kept alive from an earlier request alike."""
    body = random.Random(4).randbytes(48 * 1024 * 1024)  # past every socket buffer between
    client = make_client(server, connect_timeout=0.3, read_timeout=10.0)
    with client:
        if connection == "kept alive":
            client.info()
        server.body_stall = 1.5
        server.script(Reply(200, json=ACCEPTED))
        answer = client.submit(3, "w0", body)
    assert answer == ACCEPTED
    assert server.seen[-1].body == body and len(server.seen) == 1 + (connection != "new")


def test_an_upload_longer_than_the_read_timeout_goes_while_the_server_reads_on(
    server: FakeServer,
) -> None:
    """The read timeout bounds a pause, not the whole upload: a body that takes 4 x 1 s to
    be read, past a read timeout of 3 s, goes once (a socket's timeout is the whole of one
    sendall, so the body is sent a slice at a time; at 100 Mbit/s an 85M model's 342 MB take
    27 s, past the 10 s that once bounded a whole upload). Each pause leaves 2 s to spare: with
    0.6 s pauses under a 1 s timeout, a loaded CI machine once took the rest to read a slice."""
    server.body_stall, server.body_pauses = 1.0, 4
    body = random.Random(5).randbytes(48 * 1024 * 1024)
    server.script(Reply(200, json=ACCEPTED))
    client = make_client(server, connect_timeout=0.3, read_timeout=3.0)
    started = time.monotonic()
    with client:
        assert client.submit(3, "w0", body) == ACCEPTED
    assert time.monotonic() - started > 3.0  # the upload did outlast the read timeout
    assert len(server.seen) == 1 and server.seen[0].body == body


def test_a_large_download_arrives_byte_exact_and_counters_add_up(server: FakeServer) -> None:
    weights = random.Random(2).randbytes(20 * 1024 * 1024)
    upload = random.Random(3).randbytes(1024 * 1024)
    server.script(
        Reply(200, body=weights, headers={"X-Diloco-Round": "5"}),
        Reply(200, json=ACCEPTED),
    )
    with make_client(server) as client:
        body, round_ = client.get_weights()
        assert isinstance(body, bytearray)
        assert round_ == 5
        assert body == weights
        client.submit(5, "w0", memoryview(upload))
        stats = client.stats
    assert server.seen[1].body == upload
    assert stats.bytes_sent == len(upload)
    assert stats.bytes_received == len(weights) + len(json.dumps(ACCEPTED))
    assert stats.retries == 0
    assert set(stats.blocked_by_operation) == {"get_weights", "submit"}


def test_a_truncated_download_is_fetched_again(server: FakeServer) -> None:
    weights = random.Random(4).randbytes(300_000)
    headers = {"X-Diloco-Round": "2"}
    server.script(
        Reply(200, body=weights, headers=headers, truncate=1000),
        Reply(200, body=weights, headers=headers),
    )
    with make_client(server) as client:
        assert client.get_weights() == (bytearray(weights), 2)
        assert client.retries == 1


def test_wait_result_is_none_while_the_round_waits(server: FakeServer) -> None:
    server.script(
        Reply(202, json={"status": "waiting", "round": 4, "waiting_for": ["w2"]}),
        Reply(200, body=b"result", headers={"X-Diloco-Round": "5"}),
    )
    with make_client(server) as client:
        assert client.wait_result(4, "w1", wait=0.5) is None
        assert client.wait_result(4, "w1", wait=0.5) == Weights(bytearray(b"result"), 5)
        assert client.retries == 0
    assert [s.query for s in server.seen] == [{"worker_id": "w1", "wait": "0.5"}] * 2


def test_the_long_poll_read_timeout_covers_the_wait(server: FakeServer) -> None:
    server.script(Reply(200, body=b"result", headers={"X-Diloco-Round": "1"}, stall=0.6))
    with make_client(server, read_timeout=0.3) as client:
        assert client.wait_result(0, "w0", wait=0.5) == Weights(bytearray(b"result"), 1)
        assert client.retries == 0


def test_wait_outside_the_protocol_range_is_refused(server: FakeServer) -> None:
    with make_client(server) as client:
        for wait in (-1.0, 121.0, math.nan):
            with pytest.raises(ValueError, match="wait"):
                client.wait_result(0, "w0", wait=wait)
    assert server.seen == []


def test_blocked_seconds_include_the_backoff_sleeps(server: FakeServer) -> None:
    server.script(Reply(503), Reply(200, json={"round": 1}))
    fake_time = FakeTime()
    policy = RetryPolicy(attempts=2, base_delay=2.0, jitter=0.0)
    with make_client(server, fake_time, retry=policy) as client:
        client.status()
        stats = client.stats
    assert stats.blocked_seconds == 2.0  # the fake clock moves only while sleeping
    assert stats.blocked_by_operation == {"status": 2.0}
    assert stats.retries == 1


def test_two_threads_share_the_client_and_the_counters_stay_exact(server: FakeServer) -> None:
    server.fallback = Reply(200, json={})
    payload = b"g" * 10_000
    with make_client(server) as client:

        def submit_many() -> None:
            for round_ in range(20):
                client.submit(round_, "w0", payload)

        threads = [threading.Thread(target=submit_many) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert client.bytes_sent == 40 * len(payload)
        assert client.bytes_received == 40 * len(b"{}")
    assert len(server.seen) == 40


# -- routes, auth, URLs, lifecycle ------------------------------------------------------------


def test_routes_send_the_protocol_methods_paths_and_bodies(server: FakeServer) -> None:
    tensors = [{"name": "w", "shape": [2, 2], "dtype": "float32", "kind": "trainable"}]
    with make_client(server) as client:
        client.healthz()
        client.info()
        client.register(None, tensors)
        client.heartbeat("w0", step=12, steps_per_second=3.5, loss=math.nan, tokens=800)
        client.deregister("w0")
        client.status()
    assert [(s.method, s.path) for s in server.seen] == [
        ("GET", "/healthz"),
        ("GET", "/v1/info"),
        ("POST", "/v1/workers"),
        ("POST", "/v1/workers/w0/heartbeat"),
        ("DELETE", "/v1/workers/w0"),
        ("GET", "/v1/status"),
    ]
    register, heartbeat = server.seen[2], server.seen[3]
    assert register.headers["content-type"] == "application/json"
    assert register.json() == {"protocol_version": 1, "worker_id": None, "tensors": tensors}
    assert heartbeat.json() == {"step": 12, "steps_per_second": 3.5, "loss": None, "tokens": 800}


def test_the_bearer_token_is_sent_only_when_set(server: FakeServer) -> None:
    with make_client(server, token="s3cret") as client:
        client.info()
    with make_client(server) as client:
        client.info()
    assert server.seen[0].headers["authorization"] == "Bearer s3cret"
    assert "authorization" not in server.seen[1].headers


def test_a_base_url_path_prefixes_every_route(server: FakeServer) -> None:
    with DiLoCoClient(f"{server.url}/diloco/", retry=FAST) as client:
        client.info()
    assert server.seen[0].path == "/diloco/v1/info"


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1", "127.0.0.1:8000", "http://", "http://h/?q=1", "http://u:p@h", "http://h:x"],
)
def test_a_bad_base_url_raises_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        DiLoCoClient(url)


def test_close_wakes_a_call_that_is_backing_off(server: FakeServer) -> None:
    server.fallback = Reply(503)
    client = DiLoCoClient(server.url, retry=RetryPolicy(base_delay=30.0, jitter=0.0))
    raised: list[BaseException] = []

    def call() -> None:
        try:
            client.status()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    client.close()
    thread.join(timeout=5)
    assert time.monotonic() - started < 2
    assert len(raised) == 1 and isinstance(raised[0], ClientClosed)
    with pytest.raises(ClientClosed):
        client.info()


# -- downloads into the caller's buffer --------------------------------------------------------


def test_weights_land_in_a_given_buffer_of_the_right_size(server: FakeServer) -> None:
    first, second = random.Random(5).randbytes(50_000), random.Random(6).randbytes(50_000)
    headers = {"X-Diloco-Round": "3"}
    server.script(
        Reply(200, body=first, headers=headers),
        Reply(202, json={"status": "waiting", "round": 3, "waiting_for": ["w1"]}),
        Reply(404, json={"error": "gone", "kind": "unknown_worker", "detail": {}}),
        Reply(200, body=second, headers={"X-Diloco-Round": "4"}),
    )
    with make_client(server) as client:
        body, _ = client.get_weights()
        assert client.wait_result(3, "w0", wait=0.1, into=body) is None
        with pytest.raises(ServerError):
            client.wait_result(3, "w0", wait=0.1, into=body)
        assert body == first  # a waiting answer and an error's JSON never land in it
        got = client.wait_result(3, "w0", wait=0.1, into=body)
    assert got is not None and got.body is body and got.round == 4
    assert body == second


def test_a_buffer_of_another_size_is_left_alone(server: FakeServer) -> None:
    weights = random.Random(7).randbytes(1000)
    server.script(Reply(200, body=weights, headers={"X-Diloco-Round": "1"}))
    mine = bytearray(b"x" * 999)
    with make_client(server) as client:
        body, _ = client.get_weights(into=mine)
    assert body is not mine and body == weights
    assert mine == bytearray(b"x" * 999)


def test_a_truncated_download_into_a_buffer_is_fetched_again_in_full(server: FakeServer) -> None:
    weights = random.Random(8).randbytes(300_000)
    headers = {"X-Diloco-Round": "2"}
    server.script(
        Reply(200, body=weights, headers=headers, truncate=1000),
        Reply(200, body=weights, headers=headers),
    )
    mine = bytearray(len(weights))
    with make_client(server) as client:
        body, _ = client.get_weights(into=mine)
        assert client.retries == 1
    assert body is mine and mine == weights
