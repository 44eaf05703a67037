"""The coordinator over real HTTP: auth, body limits, every rejection, long-polls, metrics.

These tests speak the wire protocol (docs/protocol.md) with urllib3 and http.client against a
real uvicorn on 127.0.0.1, never through our own client: what a worker in another language would
see is what is checked. Every rejection must be `{"error", "kind", "detail"}` with the right
status and kind, name the tensor or field, and leave the server's state exactly as it was; a
good round afterwards must then still produce the exact weights.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from diloco.server.settings import ServerSettings
from diloco.wire import PROTOCOL_HEADER, decode_tensors, encode_tensors, fingerprint, specs_of

TOKEN = "s3cret-token"
TIMEOUT = urllib3.Timeout(connect=5.0, read=20.0)
MAX_BODY = 1024 * 1024
HUGE = 10 * 1024**3  # a Content-Length no test ever sends
SHAPES = {"layer.weight": (4, 3), "layer.bias": (3,)}
TENSOR_BYTES = sum(math.prod(shape) for shape in SHAPES.values()) * 4
# Outer SGD with lr 1 and no momentum: the new weights are the base minus the mean
# pseudo-gradient, so base 10 and pseudo-gradients -2 and -8 give exactly 15.
SETTINGS = ServerSettings(
    outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0, max_body_bytes=MAX_BODY
)


def state(value: float = 10.0, **overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = {name: torch.full(shape, value) for name, shape in SHAPES.items()}
    tensors.update(overrides)
    return tensors


SPECS = [spec.to_json() for spec in specs_of(state(), dict.fromkeys(SHAPES, "trainable"))]
FINGERPRINT = fingerprint(specs_of(state(), dict.fromkeys(SHAPES, "trainable")))


def registration(worker_id: str | None, **changes: Any) -> dict:
    return {"protocol_version": 1, "worker_id": worker_id, "tensors": SPECS, **changes}


def gradient(value: float) -> bytes:
    return encode_tensors(state(value))


# -- talking to the server --------------------------------------------------------------------


@dataclass
class Api:
    """urllib3 against one server; counts the rejections and tensor bytes the server must count."""

    url: str
    token: str | None = None
    rejected: Counter = field(default_factory=Counter)
    tensor_bytes_out: int = 0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        assert parts.hostname == "127.0.0.1"
        self.port = parts.port
        self.pool = urllib3.HTTPConnectionPool(
            "127.0.0.1", parts.port, timeout=TIMEOUT, retries=False, maxsize=4
        )

    def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        json_body: Any = None,
        authorization: str | None = None,
    ) -> urllib3.BaseHTTPResponse:
        headers = {PROTOCOL_HEADER: "1"}
        if authorization is not None:
            headers["Authorization"] = authorization
        elif self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if json_body is not None:
            body = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        elif body is not None:
            headers["Content-Type"] = "application/octet-stream"
        response = self.pool.request(method, path, body=body, headers=headers)
        if response.status == 200 and response.headers.get("content-type") == (
            "application/octet-stream"
        ):
            self.tensor_bytes_out += len(response.data)
        return response

    def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.call(method, path, **kwargs)
        assert response.status == 200, (method, path, response.status, response.data[:500])
        return response.json()

    def rejects(
        self, response: urllib3.BaseHTTPResponse, status: int, kind: str, *named: str
    ) -> dict:
        self.rejected[kind] += 1
        return check_error(response.status, response.data, status, kind, *named)

    def register(self, worker_id: str) -> dict:
        return self.ok("POST", "/v1/workers", json_body=registration(worker_id))

    def submit(self, worker_id: str, body: bytes, round_number: int = 0, query: str = ""):
        path = f"/v1/rounds/{round_number}/submissions?worker_id={worker_id}{query}"
        return self.call("POST", path, body=body)

    def result(self, worker_id: str | None, round_number: int = 0, wait: float = 0.0):
        who = f"worker_id={worker_id}&" if worker_id else ""
        return self.call("GET", f"/v1/rounds/{round_number}/result?{who}wait={wait}")

    def snapshot(self) -> dict:
        """Everything a rejection must leave alone (not clocks, not the bytes-out counter)."""
        status = self.ok("GET", "/v1/status")
        weights = self.call("GET", "/v1/weights")
        assert weights.status == 200
        return {
            "round": status["round"],
            "waiting_for": status["waiting_for"],
            "bytes_in": status["bytes_in"],
            "workers": [
                {k: v for k, v in worker.items() if k != "last_seen_seconds_ago"}
                for worker in status["workers"]
            ],
            "weights_round": weights.headers["X-Diloco-Round"],
            "weights": weights.data,
            "info": self.ok("GET", "/v1/info"),
        }

    def metrics(self) -> dict[tuple[str, tuple], float]:
        response = self.call("GET", "/metrics")
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.data.decode())
            for sample in family.samples
        }


def check_error(status: int, data: bytes, want_status: int, kind: str, *named: str) -> dict:
    """The protocol's error body: one sentence, a stable kind, the facts as an object."""
    assert status == want_status, (status, data[:500])
    body = json.loads(data)
    assert set(body) == {"error", "kind", "detail"}, body
    assert body["kind"] == kind, body
    assert isinstance(body["error"], str) and body["error"].strip(), body
    assert "\n" not in body["error"], body
    assert isinstance(body["detail"], dict), body
    for text in named:
        assert text in body["error"], (text, body)
    return body


def raw_request(
    url: str, method: str, path: str, headers: dict[str, str], first_bytes: bytes = b""
) -> tuple[int, http.client.HTTPMessage, bytes, float]:
    """Send headers and a few body bytes (maybe far fewer than announced); read the answer."""
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    connection = http.client.HTTPConnection("127.0.0.1", parts.port, timeout=5)
    started = time.monotonic()
    try:
        connection.putrequest(method, path)
        for name, value in {PROTOCOL_HEADER: "1", **headers}.items():
            connection.putheader(name, value)
        connection.endheaders(message_body=first_bytes or None)
        response = connection.getresponse()
        data = response.read()
        return response.status, response.headers, data, time.monotonic() - started
    finally:
        connection.close()


def chunked_request(url: str, method: str, path: str, token: str | None = None):
    """A body sent with Transfer-Encoding: chunked, so without a Content-Length."""
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    connection = http.client.HTTPConnection("127.0.0.1", parts.port, timeout=5)
    headers = {"Content-Type": "application/octet-stream", PROTOCOL_HEADER: "1"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request(method, path, body=iter([gradient(-2.0)]), headers=headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


@pytest.fixture
def two_workers(live_server) -> Iterator[Api]:
    """A server holding base-10 weights and two registered workers, w0 and w1, in round 0."""
    with live_server(SETTINGS, state(10.0)) as server:
        api = Api(server.url)
        for worker_id in ("w0", "w1"):
            answer = api.register(worker_id)
            assert answer["round"] == 0
            assert answer["needs_initial_weights"] is False
            assert answer["model_fingerprint"] == FINGERPRINT
        yield api


# -- every bad request, each with its status, kind and the name its sentence must hold -------


@dataclass(frozen=True)
class Bad:
    label: str
    send: Callable[[Api], urllib3.BaseHTTPResponse]
    status: int
    kind: str
    named: tuple[str, ...] = ()
    detail: dict = field(default_factory=dict)


def _post_raw(path: str, body: bytes) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.call("POST", path, body=body)


def _post_json(path: str, message: Any) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.call("POST", path, json_body=message)


def _submit(
    body: bytes, worker_id: str = "w1", round_number: int = 0, query: str = ""
) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.submit(worker_id, body, round_number, query)


def _nan_at(name: str, value: float) -> bytes:
    tensor = torch.full(SHAPES[name], -2.0)
    tensor.view(-1)[1] = value
    return encode_tensors(state(-2.0, **{name: tensor}))


_HEARTBEAT = {"step": 10, "steps_per_second": 2.5, "loss": 3.1, "tokens": 640}
_MISMATCH = [
    {"name": "layer.bias", "shape": [4], "dtype": "float32", "kind": "trainable"},
    {"name": "layer.weight", "shape": [4, 3], "dtype": "int64", "kind": "int_buffer"},
]
_WITHOUT_BIAS = state(-2.0)
del _WITHOUT_BIAS["layer.bias"]

# fmt: off
BAD_REQUESTS = [
    # registration
    Bad("register: not JSON", _post_raw("/v1/workers", b'{"protocol_version": 1, "work'),
        422, "invalid_request", ("JSON",)),
    Bad("register: not an object", _post_json("/v1/workers", [1, 2]),
        422, "invalid_request", ("JSON object",)),
    Bad("register: no tensors", _post_json("/v1/workers", {
        "protocol_version": 1, "worker_id": "w2"}),
        422, "invalid_request", ("'tensors'",), {"field": "tensors"}),
    Bad("register: no worker_id", _post_json("/v1/workers", {
        "protocol_version": 1, "tensors": SPECS}),
        422, "invalid_request", ("'worker_id'",), {"field": "worker_id"}),
    Bad("register: bad dtype", _post_json("/v1/workers", registration(
        "w2", tensors=[{**SPECS[0], "dtype": "float8"}, SPECS[1]])),
        422, "invalid_request", ("'tensors.0.dtype'",), {"field": "tensors.0.dtype"}),
    Bad("register: unknown field", _post_json("/v1/workers", registration("w2", colour="red")),
        422, "invalid_request", ("'colour'",), {"field": "colour"}),
    Bad("register: waits_for_initial not a bool", _post_json(
        "/v1/workers", registration("w2", waits_for_initial="yes")),
        422, "invalid_request", ("'waits_for_initial'",), {"field": "waits_for_initial"}),
    Bad("register: bad id", _post_json("/v1/workers", registration("bad id!")),
        422, "invalid_request", ("'worker_id'",), {"field": "worker_id"}),
    Bad("register: protocol 2", _post_json("/v1/workers", registration("w2", protocol_version=2)),
        400, "protocol_version", ("protocol_version", "2"), {"expected": 1, "got": 2}),
    Bad("register: protocol 2 before fields", _post_json(
        "/v1/workers", {"protocol_version": 2, "worker_id": "w2"}),
        400, "protocol_version", ("protocol_version",)),
    Bad("register: live id", _post_json("/v1/workers", registration("w0")),
        409, "worker_id_taken", ("'w0'",), {"worker_id": "w0"}),
    Bad("register: other model", _post_json("/v1/workers", registration("w2", tensors=_MISMATCH)),
        422, "fingerprint_mismatch", ("'layer.bias'",), {"expected": FINGERPRINT}),
    Bad("register: other model before the id", _post_json(
        "/v1/workers", registration("w0", tensors=_MISMATCH)),
        422, "fingerprint_mismatch", ("'layer.bias'",)),
    # heartbeat
    Bad("heartbeat: not JSON", _post_raw("/v1/workers/w0/heartbeat", b"{step: 1}"),
        422, "invalid_request", ("JSON",)),
    Bad("heartbeat: no tokens", _post_json("/v1/workers/w0/heartbeat", {
        k: v for k, v in _HEARTBEAT.items() if k != "tokens"}),
        422, "invalid_request", ("'tokens'",), {"field": "tokens"}),
    Bad("heartbeat: step a string", _post_json("/v1/workers/w0/heartbeat", {
        **_HEARTBEAT, "step": "ten"}),
        422, "invalid_request", ("'step'",), {"field": "step"}),
    Bad("heartbeat: NaN loss", _post_raw("/v1/workers/w0/heartbeat", json.dumps(
        {**_HEARTBEAT, "loss": float("nan")}).encode()),
        422, "invalid_request", ("'loss'",), {"field": "loss"}),
    Bad("heartbeat: ghost", _post_json("/v1/workers/ghost/heartbeat", _HEARTBEAT),
        404, "unknown_worker", ("'ghost'",), {"worker_id": "ghost"}),
    # submissions
    Bad("submit: garbage", _submit(b"this is not a safetensors file"),
        422, "malformed_safetensors"),
    Bad("submit: too short", _submit(b"\x01\x00"), 422, "malformed_safetensors"),
    Bad("submit: empty", _submit(b""), 422, "malformed_safetensors"),
    Bad("submit: unknown tensor", _submit(encode_tensors(state(-2.0, extra=torch.zeros(2)))),
        422, "unknown_tensor", ("'extra'",), {"tensor": "extra"}),
    Bad("submit: missing tensor", _submit(encode_tensors(_WITHOUT_BIAS)),
        422, "missing_tensor", ("'layer.bias'",), {"tensor": "layer.bias"}),
    Bad("submit: wrong shape", _submit(encode_tensors(state(-2.0, **{
        "layer.weight": torch.full((3, 4), -2.0)}))),
        422, "wrong_shape", ("'layer.weight'", "[3, 4]", "[4, 3]"),
        {"tensor": "layer.weight", "expected": [4, 3], "got": [3, 4]}),
    Bad("submit: float64", _submit(encode_tensors(state(-2.0, **{
        "layer.bias": torch.full((3,), -2.0, dtype=torch.float64)}))),
        422, "wrong_dtype", ("'layer.bias'", "float64"), {"tensor": "layer.bias"}),
    Bad("submit: bf16 to an fp32 server", _submit(encode_tensors(state(-2.0), torch.bfloat16)),
        422, "wrong_dtype", ("bfloat16",)),
    Bad("submit: NaN", _submit(_nan_at("layer.weight", float("nan"))),
        422, "non_finite", ("'layer.weight'",), {"tensor": "layer.weight", "count": 1}),
    Bad("submit: Inf", _submit(_nan_at("layer.bias", float("-inf"))),
        422, "non_finite", ("'layer.bias'",), {"tensor": "layer.bias", "count": 1}),
    Bad("submit: ghost", _submit(gradient(-2.0), worker_id="ghost"),
        404, "unknown_worker", ("'ghost'",), {"worker_id": "ghost"}),
    Bad("submit: future round", _submit(gradient(-2.0), round_number=1),
        409, "future_round", ("round 1",), {"current_round": 0, "fragment": 0}),
    Bad("submit: fragment 1 in sync mode", _submit(gradient(-2.0), query="&fragment=1"),
        422, "invalid_request", ("'fragment'",), {"field": "fragment"}),
    Bad("submit: negative fragment", _submit(gradient(-2.0), query="&fragment=-1"),
        422, "invalid_request", ("fragment",)),
    Bad("submit: negative tokens", _submit(gradient(-2.0), query="&tokens=-5"),
        422, "invalid_request", ("tokens",)),
    Bad("submit: no worker_id", lambda api: api.call(
        "POST", "/v1/rounds/0/submissions", body=gradient(-2.0)),
        422, "invalid_request", ("worker_id",)),
    Bad("submit: round not a number", lambda api: api.call(
        "POST", "/v1/rounds/zero/submissions?worker_id=w1", body=gradient(-2.0)),
        422, "invalid_request", ("'round_number'",), {"field": "round_number"}),
    # initial weights, results, departures
    Bad("initial upload over existing weights", lambda api: api.call(
        "PUT", "/v1/weights/initial?worker_id=w1", body=encode_tensors(state(99.0))),
        409, "weights_exist", (), {"current_round": 0}),
    Bad("result: wait over 120", lambda api: api.result("w0", wait=120.5),
        422, "invalid_request", ("wait",)),
    Bad("result: negative wait", lambda api: api.result("w0", wait=-1),
        422, "invalid_request", ("wait",)),
    Bad("result: future round", lambda api: api.result("w0", round_number=3),
        409, "future_round", ("round 3",), {"current_round": 0, "fragment": 0}),
    Bad("result: ghost", lambda api: api.result("ghost"),
        404, "unknown_worker", ("'ghost'",)),
    Bad("deregister: ghost", lambda api: api.call("DELETE", "/v1/workers/ghost"),
        404, "unknown_worker", ("'ghost'",)),
]
# fmt: on


def _send_bad(api: Api, bad: Bad) -> None:
    body = api.rejects(bad.send(api), bad.status, bad.kind, *bad.named)
    for key, value in bad.detail.items():
        assert body["detail"].get(key) == value, (bad.label, key, body)


# Raw-socket rejections: a huge announced body (refused unread) and a chunked one (no length).
RAW_REQUESTS = [
    ("POST", "/v1/rounds/0/submissions?worker_id=w1", "submission"),
    ("PUT", "/v1/weights/initial?worker_id=w1", "initial upload"),
    ("POST", "/v1/workers", "registration"),
    ("POST", "/v1/workers/w0/heartbeat", "heartbeat"),
]


def _send_too_large(api: Api, method: str, path: str) -> None:
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(HUGE)}
    if api.token is not None:
        headers["Authorization"] = f"Bearer {api.token}"
    status, _, data, elapsed = raw_request(api.url, method, path, headers, b"\x08\x00\x00")
    body = check_error(status, data, 413, "body_too_large", str(HUGE))
    assert body["detail"]["content_length"] == HUGE
    assert elapsed < 3.0, f"the 413 took {elapsed:.1f} s: the server read the body first?"
    api.rejected["body_too_large"] += 1


def _send_chunked(api: Api, method: str, path: str) -> None:
    status, _, data = chunked_request(api.url, method, path, api.token)
    check_error(status, data, 411, "length_required", "Content-Length")
    api.rejected["length_required"] += 1


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "what"), RAW_REQUESTS, ids=[r[2] for r in RAW_REQUESTS])
def test_body_over_the_limit_is_413_before_it_is_read_and_chunked_is_411(
    two_workers, method, path, what
):
    api = two_workers
    before = api.snapshot()
    _send_too_large(api, method, path)
    _send_chunked(api, method, path)
    assert api.snapshot() == before
    assert api.metrics()[("diloco_rejected_requests_total", (("kind", "body_too_large"),))] == 1


def test_a_volley_of_bad_requests_then_an_exact_round(two_workers):
    """Every rejection above changes nothing; then a good round: 15 everywhere, identical bytes,
    and metrics that count exactly what happened."""
    api = two_workers
    before = api.snapshot()
    for bad in BAD_REQUESTS:
        _send_bad(api, bad)
        assert api.snapshot() == before, f"{bad.label} changed the server's state"
    for method, path, what in RAW_REQUESTS:
        _send_too_large(api, method, path)
        _send_chunked(api, method, path)
        assert api.snapshot() == before, f"a refused {what} changed the server's state"
    assert before["round"] == 0 and before["waiting_for"] == ["w0", "w1"]

    first = api.submit("w0", gradient(-2.0))
    assert first.status == 200
    assert first.json() == {
        "status": "accepted",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["w1"],
    }
    # An unregistered worker cannot stand in for w1, and a retry of w0 counts once.
    api.rejects(api.submit("ghost", gradient(-8.0)), 404, "unknown_worker", "'ghost'")
    assert api.ok("POST", "/v1/rounds/0/submissions?worker_id=w0", body=gradient(-8.0)) == {
        "status": "duplicate",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["w1"],
    }
    # ... and a worker that already submitted has its (now invalid) retry counted once, too.
    assert (
        api.ok(
            "POST",
            "/v1/rounds/0/submissions?worker_id=w0",
            body=_nan_at("layer.weight", float("nan")),
        )["status"]
        == "duplicate"
    )
    waiting = api.result("w0", wait=0.2)
    assert waiting.status == 202
    assert waiting.json() == {
        "status": "waiting",
        "round": 0,
        "waiting_for": ["w1"],
        "more_submissions_needed": 0,
    }
    assert api.ok("GET", "/v1/status")["waiting_for"] == ["w1"]

    # A long-poll already waiting is woken by the commit.
    polled: dict[str, Any] = {}

    def long_poll() -> None:
        started = time.monotonic()
        response = api.result("w0", wait=15)
        polled.update(response=response, elapsed=time.monotonic() - started)

    poller = threading.Thread(target=long_poll)
    poller.start()
    time.sleep(0.3)
    last = api.ok("POST", "/v1/rounds/0/submissions?worker_id=w1", body=gradient(-8.0))
    assert last["status"] == "accepted" and last["round"] == 0 and last["current_round"] == 1
    poller.join(timeout=20)
    assert not poller.is_alive()
    assert polled["elapsed"] < 5.0

    bodies = [
        polled["response"],
        api.result("w1"),
        api.result(None),
        api.call("GET", "/v1/weights"),
    ]
    for response in bodies:
        assert response.status == 200
        assert response.headers["X-Diloco-Round"] == "1"
        assert response.headers["content-type"] == "application/octet-stream"
    assert len({response.data for response in bodies}) == 1  # byte-identical for every worker
    result = decode_tensors(bodies[0].data)
    assert set(result) == set(SHAPES)
    for name, tensor in result.items():
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == SHAPES[name]
        assert torch.equal(tensor, torch.full(SHAPES[name], 15.0)), name

    # A retry to the committed round, which used w0's first send, is a duplicate, unused.
    late = api.ok("POST", "/v1/rounds/0/submissions?worker_id=w0", body=gradient(-100.0))
    assert late["status"] == "duplicate" and late["current_round"] == 1
    assert torch.equal(
        decode_tensors(api.call("GET", "/v1/weights").data)["layer.bias"], torch.full((3,), 15.0)
    )

    status = api.ok("GET", "/v1/status")
    assert status["round"] == 1 and status["waiting_for"] == ["w0", "w1"]
    assert status["bytes_in"] == 2 * TENSOR_BYTES
    assert status["bytes_out"] == api.tensor_bytes_out
    assert {w["worker_id"]: w["rounds_contributed"] for w in status["workers"]} == {
        "w0": 1,
        "w1": 1,
    }

    metrics = api.metrics()
    assert metrics[("diloco_rounds_total", ())] == 1.0
    assert metrics[("diloco_round", ())] == 1.0
    assert metrics[("diloco_live_workers", ())] == 2.0
    assert metrics[("diloco_bytes_in_total", ())] == 2 * TENSOR_BYTES
    assert metrics[("diloco_bytes_out_total", ())] == api.tensor_bytes_out
    rejected = {
        dict(labels)["kind"]: value
        for (name, labels), value in metrics.items()
        if name == "diloco_rejected_requests_total"
    }
    assert rejected == dict(api.rejected)
    assert rejected["non_finite"] == 2
    assert metrics[("diloco_outer_step_seconds_count", ())] == 1.0
    parts = {
        dict(labels)["part"]: value
        for (name, labels), value in metrics.items()
        if name == "diloco_round_part_seconds_count"
    }
    # two bodies folded (the refused ones never were), one step and its parts; the first
    # body of a round is checked while it is folded, so only the second one is scanned alone
    assert parts == {
        "scan": 1, "fold": 2, "outer_step": 1, "delta": 1, "checkpoint": 1, "commit": 1
    }  # fmt: skip


def test_long_poll_waits_then_expires_old_rounds(live_server):
    with live_server(SETTINGS, state(10.0)) as server:
        api = Api(server.url)
        api.register("w0")
        started = time.monotonic()
        waiting = api.result(None, wait=0.2)  # an observer (a dashboard) may wait on a round
        elapsed = time.monotonic() - started
        assert waiting.status == 202
        assert waiting.json() == {
            "status": "waiting",
            "round": 0,
            "waiting_for": ["w0"],
            "more_submissions_needed": 0,
        }
        assert 0.2 <= elapsed < 3.0
        # A member that waits without having submitted is told to submit (after a restart
        # the server lost its submission, and the worker sends it again).
        missing = api.result("w0", wait=0)
        assert missing.status == 409 and missing.json()["kind"] == "not_submitted"
        assert missing.json()["detail"] == {"round": 0, "fragment": 0, "worker_id": "w0"}

        for round_number, value in ((0, -2.0), (1, -4.0)):
            answer = api.ok(
                "POST", f"/v1/rounds/{round_number}/submissions?worker_id=w0", body=gradient(value)
            )
            assert answer["current_round"] == round_number + 1
        expired = api.rejects(api.result("w0", round_number=0), 410, "result_expired", "round 0")
        assert expired["detail"]["current_round"] == 2
        kept = api.result("w0", round_number=1, wait=120)  # the largest wait is allowed
        assert kept.status == 200 and kept.headers["X-Diloco-Round"] == "2"
        # 10 - (-2) = 12, then 12 - (-4) = 16
        assert torch.equal(decode_tensors(kept.data)["layer.weight"], torch.full((4, 3), 16.0))
        api.rejects(api.result("w0", round_number=1, wait=121), 422, "invalid_request", "wait")
        assert api.ok("GET", "/v1/status")["round"] == 2


def test_initial_upload_over_http(live_server):
    """No --init: the first worker uploads the weights once; bad uploads change nothing."""
    with live_server(SETTINGS) as server:
        api = Api(server.url)
        assert api.ok("GET", "/v1/info")["model_fingerprint"] is None
        api.rejects(api.call("GET", "/v1/weights"), 404, "no_weights")
        answer = api.register("w0")
        assert answer["needs_initial_weights"] is True
        upload = "/v1/weights/initial?worker_id=w0"
        api.rejects(
            api.call("PUT", upload, body=_nan_at("layer.bias", float("inf"))),
            422,
            "non_finite",
            "'layer.bias'",
        )
        api.rejects(
            api.call("PUT", upload, body=encode_tensors(_WITHOUT_BIAS)),
            422,
            "missing_tensor",
            "'layer.bias'",
        )
        api.rejects(
            api.call("PUT", "/v1/weights/initial?worker_id=ghost", body=gradient(1.0)),
            404,
            "unknown_worker",
            "'ghost'",
        )
        api.rejects(api.call("GET", "/v1/weights"), 404, "no_weights")
        assert api.ok("GET", "/v1/info")["model_fingerprint"] is None

        initial = state(10.0, **{"layer.bias": torch.tensor([1.0, 2.0, 3.0])})
        stored = api.ok("PUT", upload, body=encode_tensors(initial, torch.bfloat16))
        assert stored == {"status": "stored", "round": 0}
        api.rejects(api.call("PUT", upload, body=gradient(99.0)), 409, "weights_exist")
        weights = api.call("GET", "/v1/weights")
        assert weights.status == 200 and weights.headers["X-Diloco-Round"] == "0"
        served = decode_tensors(weights.data)
        for name, tensor in initial.items():
            assert served[name].dtype == torch.float32
            assert torch.equal(served[name], tensor), name
        assert api.ok("GET", "/v1/info")["model_fingerprint"] == FINGERPRINT


# -- auth and discovery -----------------------------------------------------------------------

PROTECTED = [
    ("GET", "/openapi.json"),
    ("GET", "/v1/info"),
    ("GET", "/v1/status"),
    ("GET", "/metrics"),
    ("GET", "/v1/weights"),
    ("POST", "/v1/workers"),
    ("DELETE", "/v1/workers/w0"),
    ("POST", "/v1/workers/w0/heartbeat"),
    ("PUT", "/v1/weights/initial?worker_id=w0"),
    ("POST", "/v1/rounds/0/submissions?worker_id=w0"),
    ("POST", "/v1/rounds/zero/submissions"),  # 401 comes before the request is validated
    ("GET", "/v1/rounds/0/result?worker_id=w0&wait=0"),
    ("GET", "/v1/rounds/0/result?wait=500"),
]
WRONG_AUTHORIZATION = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer wrong-token",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Basic {TOKEN}",
    TOKEN,
    f"Token {TOKEN}",
]


def test_token_guards_every_route_but_healthz(live_server):
    with live_server(SETTINGS, state(10.0), TOKEN) as server:
        anonymous = Api(server.url)
        health = anonymous.call("GET", "/healthz", authorization="")
        assert health.status == 200 and health.json() == {"ok": True}
        assert anonymous.call("GET", "/healthz", authorization="Bearer wrong").status == 200

        bodies = {"POST": json.dumps(registration("w0")).encode(), "PUT": gradient(1.0)}
        for method, path in PROTECTED:
            for authorization in WRONG_AUTHORIZATION:
                response = anonymous.pool.request(
                    method,
                    path,
                    body=bodies.get(method),
                    headers={} if authorization is None else {"Authorization": authorization},
                )
                anonymous.rejects(response, 401, "unauthorized", "token")
                assert response.headers["WWW-Authenticate"] == 'Bearer realm="diloco"', (
                    method,
                    path,
                    authorization,
                )
        # Refused before the body is read, too.
        status, headers, data, elapsed = raw_request(
            server.url,
            "PUT",
            "/v1/weights/initial?worker_id=w0",
            {"Content-Length": str(HUGE), "Authorization": "Bearer nope"},
            b"\x00",
        )
        check_error(status, data, 401, "unauthorized")
        assert headers["WWW-Authenticate"] == 'Bearer realm="diloco"' and elapsed < 3.0
        anonymous.rejected["unauthorized"] += 1

        # Nothing happened: no worker registered, round 0.
        api = Api(server.url, TOKEN)
        status_body = api.ok("GET", "/v1/status")
        assert status_body["workers"] == [] and status_body["round"] == 0
        assert (
            api.metrics()[("diloco_rejected_requests_total", (("kind", "unauthorized"),))]
            == (anonymous.rejected["unauthorized"])
        )

        # The right token works with the scheme in any case.
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            info = api.ok("GET", "/v1/info", authorization=f"{scheme} {TOKEN}")
            assert info["protocol_version"] == 1 and info["model_fingerprint"] == FINGERPRINT
        registered = api.register("w0")
        assert registered["worker_id"] == "w0"
        # The enrollment token registers; what acts as w0 is the credential it was issued.
        w0 = Api(server.url, registered["credential"])
        beat = w0.ok("POST", "/v1/workers/w0/heartbeat", json_body=_HEARTBEAT)
        assert beat == {"round": 0, "recommended_sync_every": None, "command": None}
        _send_too_large(w0, "POST", "/v1/rounds/0/submissions?worker_id=w0")
        assert (
            w0.ok("POST", "/v1/rounds/0/submissions?worker_id=w0", body=gradient(-5.0))[
                "current_round"
            ]
            == 1
        )
        assert w0.result("w0").headers["X-Diloco-Round"] == "1"
        assert b"diloco_rounds_total 1.0" in api.call("GET", "/metrics").data


def test_openapi_is_served_behind_the_token_and_lists_the_routes(live_server):
    """/openapi.json needs the token like every route but /healthz; it lists /v1."""
    with live_server(SETTINGS, None, TOKEN) as server:
        anonymous = Api(server.url)
        anonymous.rejects(anonymous.call("GET", "/openapi.json"), 401, "unauthorized")
        api = Api(server.url, TOKEN)
        response = api.call("GET", "/openapi.json")
        assert response.status == 200
        schema = response.json()
        paths = schema["paths"]
        for route, methods in {
            "/healthz": {"get"},
            "/metrics": {"get"},
            "/v1/info": {"get"},
            "/v1/status": {"get"},
            "/v1/workers": {"post"},
            "/v1/workers/{worker_id}": {"delete"},
            "/v1/workers/{worker_id}/heartbeat": {"post"},
            "/v1/weights": {"get"},
            "/v1/weights/initial": {"put"},
            "/v1/rounds/{round_number}/submissions": {"post"},
            "/v1/rounds/{round_number}/result": {"get"},
        }.items():
            assert route in paths, route
            assert methods <= set(paths[route]), (route, set(paths[route]))
        # The JSON bodies the routes parse themselves are still documented.
        register_body = paths["/v1/workers"]["post"]["requestBody"]["content"]
        properties = register_body["application/json"]["schema"]["properties"]
        assert {"protocol_version", "worker_id", "tensors"} <= set(properties)
        heartbeat_body = paths["/v1/workers/{worker_id}/heartbeat"]["post"]["requestBody"]
        assert "step" in heartbeat_body["content"]["application/json"]["schema"]["properties"]
        # A nested model is written out where it is used: a "#/$defs/..." reference would
        # point at the document's root, which has no $defs (clients could not resolve it).
        assert "#/$defs/" not in response.data.decode()
        tensors = properties["tensors"]["items"]
        assert {"name", "shape", "dtype", "kind"} <= set(tensors["properties"])
        # The rest of the API needs the token too.
        anonymous.rejects(anonymous.call("GET", "/v1/info"), 401, "unauthorized")


def test_streaming_over_http_bad_fragments_then_an_exact_fragment_round(live_server) -> None:
    """Fragment index out of range, a fragment body carrying the other fragment's tensor, a
    result for no fragment: 422 naming the value, nothing changed; then a fragment round."""
    settings = ServerSettings(
        mode="streaming", sync_every=2, fragments=2, outer_optimizer="sgd", outer_lr=1.0,
        outer_momentum=0.0, max_body_bytes=MAX_BODY,
    )  # fmt: skip
    with live_server(settings, state(10.0)) as server:
        api = Api(server.url)
        api.register("w0")
        api.register("w1")
        info = api.ok("GET", "/v1/info")
        assert info["fragment_plan"] == [["layer.weight"], ["layer.bias"]]
        weight_only = encode_tensors({"layer.weight": torch.full((4, 3), -2.0)})
        before = api.snapshot()
        api.rejects(
            api.submit("w0", weight_only, query="&fragment=2"), 422, "invalid_request", "[0, 1]"
        )
        api.rejects(api.submit("w0", weight_only, query="&fragment=-1"), 422, "invalid_request")
        both = api.rejects(
            api.submit("w0", gradient(-2.0), query="&fragment=0"),
            422,
            "wrong_fragment",
            "'layer.bias'",
        )
        assert both["detail"] == {"tensor": "layer.bias", "fragment": 0, "belongs_to": 1}
        api.rejects(
            api.call("GET", "/v1/rounds/0/result?fragment=7&wait=0"), 422, "invalid_request"
        )
        assert api.snapshot() == before

        assert api.submit("w0", weight_only, query="&fragment=0").status == 200
        other = encode_tensors({"layer.weight": torch.full((4, 3), -8.0)})
        assert api.submit("w1", other, query="&fragment=0").json()["current_round"] == 1
        result = api.call("GET", "/v1/rounds/0/result?worker_id=w0&fragment=0&wait=5")
        assert result.status == 200
        assert (result.headers["X-Diloco-Round"], result.headers["X-Diloco-Fragment"]) == ("1", "0")
        assert set(decode_tensors(result.data)) == {"layer.weight"}
        assert torch.equal(decode_tensors(result.data)["layer.weight"], torch.full((4, 3), 15.0))
        weights = api.call("GET", "/v1/weights")
        assert weights.headers["X-Diloco-Fragment-Rounds"] == "1,0"
        assert weights.headers["X-Diloco-Round"] == "1"
        assert torch.equal(decode_tensors(weights.data)["layer.bias"], torch.full((3,), 10.0))
