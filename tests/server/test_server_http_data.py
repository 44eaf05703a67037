"""Work units over real HTTP: every bad request to the data routes, auth, progress numbers.

Spoken with urllib3 against a real uvicorn on 127.0.0.1 (the `live_server` fixture), never
through our own client, as in test_server_http. Every rejection must be the protocol's
`{"error", "kind", "detail"}` with the right status and kind, name the field, and leave the
server's state (round, submissions, weights, work units) exactly as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import urllib3
from test_server_http import (
    SETTINGS,
    TOKEN,
    Api,
    check_error,
    gradient,
    raw_request,
    state,
)

from diloco.algorithm.permutation import Permutation
from diloco.wire import decode_tensors

DATASET = {"worker_id": "w0", "dataset_id": "ds", "length": 100, "shuffle_seed": 7, "unit_size": 10}
LEASES = "/v1/datasets/ds/leases"


def snapshot(api: Api) -> dict:
    """Api.snapshot plus the work units: what a refused request must leave alone."""
    return {**api.snapshot(), "datasets": api.ok("GET", "/v1/datasets")}


@pytest.fixture
def served(live_server) -> Iterator[tuple[Api, Any]]:
    """Base-10 weights, workers w0 and w1, dataset `ds` (100 samples, units of 10, seed 7);
    w0 holds units 1 and 2 (indices 0 and 1 of epoch 0), w1 holds unit 3."""
    with live_server(SETTINGS, state(10.0)) as server:
        api = Api(server.url)
        api.register("w0")
        api.register("w1")
        shape = api.ok("POST", "/v1/datasets", json_body=DATASET)
        assert shape == {
            "dataset_id": "ds",
            "length": 100,
            "unit_size": 10,
            "shuffle_seed": 7,
            "units_per_epoch": 10,
            "epoch": 0,
        }
        first = api.ok("POST", LEASES, json_body={"worker_id": "w0", "count": 2})
        assert [u["unit_id"] for u in first["units"]] == [1, 2]
        assert api.ok("POST", LEASES, json_body={"worker_id": "w1"})["units"][0]["unit_id"] == 3
        yield api, server


# -- every bad request ------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    label: str
    send: Callable[[Api], urllib3.BaseHTTPResponse]
    status: int
    kind: str
    named: tuple[str, ...] = ()
    detail: dict = field(default_factory=dict)


def _post(path: str, message: Any) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.call("POST", path, json_body=message)


def _raw(path: str, body: bytes) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.call("POST", path, body=body)


def _dataset(**changes: Any) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    message = {**DATASET, **changes}
    return _post("/v1/datasets", {k: v for k, v in message.items() if v is not _DROP})


def _lease(path: str = LEASES, **changes: Any) -> Callable[[Api], urllib3.BaseHTTPResponse]:
    message = {"worker_id": "w0", "count": 1, **changes}
    return _post(path, {k: v for k, v in message.items() if v is not _DROP})


def _units(units: str, worker_id: str = "w1") -> Callable[[Api], urllib3.BaseHTTPResponse]:
    return lambda api: api.submit(worker_id, gradient(-8.0), 0, f"&units={units}")


_DROP = object()

# fmt: off
BAD_REQUESTS = [
    # POST /v1/datasets
    Bad("dataset: not JSON", _raw("/v1/datasets", b'{"worker_id": "w0", "data'),
        422, "invalid_request", ("JSON",)),
    Bad("dataset: not an object", _post("/v1/datasets", [DATASET]),
        422, "invalid_request"),
    *[Bad(f"dataset: no {name}", _dataset(**{name: _DROP}),
          422, "invalid_request", (f"'{name}'",), {"field": name})
      for name in ("worker_id", "dataset_id", "length", "unit_size")],
    Bad("dataset: length a string", _dataset(length="100"),
        422, "invalid_request", ("'length'",), {"field": "length"}),
    Bad("dataset: length a float", _dataset(length=100.0),
        422, "invalid_request", ("'length'",), {"field": "length"}),
    Bad("dataset: length true", _dataset(length=True),
        422, "invalid_request", ("'length'",), {"field": "length"}),
    Bad("dataset: length 0", _dataset(length=0),
        422, "invalid_request", ("length",), {"field": "length"}),
    Bad("dataset: length 2**53 + 1", _dataset(length=2**53 + 1),
        422, "invalid_request", ("length",), {"field": "length"}),
    Bad("dataset: unit_size a float", _dataset(unit_size=10.5),
        422, "invalid_request", ("'unit_size'",), {"field": "unit_size"}),
    Bad("dataset: unit_size 0", _dataset(unit_size=0),
        422, "invalid_request", ("unit_size",), {"field": "unit_size"}),
    Bad("dataset: unit_size 65537", _dataset(unit_size=65_537),
        422, "invalid_request", ("unit_size",), {"field": "unit_size"}),
    Bad("dataset: seed a string", _dataset(shuffle_seed="7"),
        422, "invalid_request", ("'shuffle_seed'",), {"field": "shuffle_seed"}),
    Bad("dataset: seed -1", _dataset(shuffle_seed=-1),
        422, "invalid_request", ("shuffle_seed",), {"field": "shuffle_seed"}),
    Bad("dataset: id a number", _dataset(dataset_id=5),
        422, "invalid_request", ("'dataset_id'",), {"field": "dataset_id"}),
    Bad("dataset: id of 129 characters", _dataset(dataset_id="d" * 129),
        422, "invalid_request", ("dataset_id",), {"field": "dataset_id"}),
    Bad("dataset: id with a slash", _dataset(dataset_id="a/b"),
        422, "invalid_request", ("dataset_id",), {"field": "dataset_id"}),
    Bad("dataset: empty id", _dataset(dataset_id=""),
        422, "invalid_request", ("dataset_id",), {"field": "dataset_id"}),
    Bad("dataset: bad worker id", _dataset(worker_id="bad id!"),
        422, "invalid_request", ("'worker_id'",), {"field": "worker_id"}),
    Bad("dataset: unknown field", _dataset(colour="red"),
        422, "invalid_request", ("'colour'",), {"field": "colour"}),
    Bad("dataset: ghost worker", _dataset(worker_id="ghost", dataset_id="new"),
        404, "unknown_worker", ("'ghost'",), {"worker_id": "ghost"}),
    Bad("dataset: another length", _dataset(length=101),
        409, "dataset_conflict", ("length=100",),
        {"dataset_id": "ds", "field": "length", "expected": 100, "got": 101}),
    Bad("dataset: another unit size", _dataset(unit_size=20),
        409, "dataset_conflict", ("unit_size=10",),
        {"field": "unit_size", "expected": 10, "got": 20}),
    Bad("dataset: another seed", _dataset(shuffle_seed=8),
        409, "dataset_conflict", ("shuffle_seed=7",),
        {"field": "shuffle_seed", "expected": 7, "got": 8}),
    Bad("dataset: seed left to its default 0", _dataset(shuffle_seed=_DROP),
        409, "dataset_conflict", ("shuffle_seed",), {"field": "shuffle_seed", "got": 0}),
    # POST /v1/datasets/{dataset_id}/leases
    Bad("lease: not JSON", _raw(LEASES, b"{worker_id: w0}"),
        422, "invalid_request", ("JSON",)),
    Bad("lease: no worker_id", _lease(worker_id=_DROP),
        422, "invalid_request", ("'worker_id'",), {"field": "worker_id"}),
    Bad("lease: count a float", _lease(count=2.0),
        422, "invalid_request", ("'count'",), {"field": "count"}),
    Bad("lease: count a string", _lease(count="2"),
        422, "invalid_request", ("'count'",), {"field": "count"}),
    Bad("lease: count null", _lease(count=None),
        422, "invalid_request", ("'count'",), {"field": "count"}),
    Bad("lease: count 0", _lease(count=0),
        422, "invalid_request", ("count",), {"field": "count"}),
    Bad("lease: count -1", _lease(count=-1),
        422, "invalid_request", ("count",), {"field": "count"}),
    Bad("lease: count 2000", _lease(count=2000),
        422, "invalid_request", ("count", "1024"), {"field": "count"}),
    Bad("lease: lease_key of 7 characters", _lease(lease_key="k" * 7),
        422, "invalid_request", ("'lease_key'", "8"), {"field": "lease_key"}),
    Bad("lease: lease_key of 65 characters", _lease(lease_key="k" * 65),
        422, "invalid_request", ("'lease_key'", "64"), {"field": "lease_key"}),
    Bad("lease: lease_key a number", _lease(lease_key=12345678),
        422, "invalid_request", ("'lease_key'",), {"field": "lease_key"}),
    Bad("lease: next_epoch a string", _lease(next_epoch="yes"),
        422, "invalid_request", ("'next_epoch'",), {"field": "next_epoch"}),
    Bad("lease: next_epoch a number", _lease(next_epoch=1),
        422, "invalid_request", ("'next_epoch'",), {"field": "next_epoch"}),
    Bad("lease: unknown field", _lease(units=3),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("lease: bad worker id", _lease(worker_id="w 0"),
        422, "invalid_request", ("'worker_id'",), {"field": "worker_id"}),
    Bad("lease: ghost worker", _lease(worker_id="ghost"),
        404, "unknown_worker", ("'ghost'",), {"worker_id": "ghost"}),
    Bad("lease: unknown dataset", _lease("/v1/datasets/nope/leases"),
        404, "unknown_dataset", ("'nope'",), {"dataset_id": "nope"}),
    Bad("lease: bad dataset id", _lease("/v1/datasets/bad%20id/leases"),
        422, "invalid_request", ("dataset_id",), {"field": "dataset_id"}),
    # the `units` of a submission
    Bad("units: letters", _units("a,b"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: an empty item", _units("1,,2"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: a trailing comma", _units("3,"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: negative", _units("-1"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: a float", _units("3.0"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: a space", _units("%203"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: 0", _units("0"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: a superscript two", _units("%C2%B2"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: an Arabic-Indic one", _units("%D9%A1"),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: 19 digits", _units("1" * 19),
        422, "invalid_request", ("'units'",), {"field": "units"}),
    Bad("units: 4097 of them", _units(",".join(str(i) for i in range(1, 4098))),
        422, "invalid_request", ("'units'", "4096"), {"field": "units"}),
    Bad("units: another worker's", _units("3,1"),
        422, "unit_not_leased", ("work unit 1", "'w0'"),
        {"unit_id": 1, "worker_id": "w1", "holder": "w0", "state": "leased"}),
    Bad("units: never leased", _units("99"),
        422, "unknown_unit", ("99",), {"unit_id": 99}),
]
# fmt: on


def test_every_bad_data_request_is_refused_naming_the_field_and_changes_nothing(served) -> None:
    api, _ = served
    before = snapshot(api)
    for bad in BAD_REQUESTS:
        response = bad.send(api)
        body = check_error(response.status, response.data, bad.status, bad.kind, *bad.named)
        for key, value in bad.detail.items():
            assert body["detail"].get(key) == value, (bad.label, key, body)
        assert snapshot(api) == before, f"{bad.label} changed the server's state"
    # The round still takes both submissions, with the units each holds.
    assert api.submit("w0", gradient(-2.0), 0, "&units=2,1").json()["status"] == "accepted"
    assert api.submit("w1", gradient(-8.0), 0, "&units=3").json()["current_round"] == 1
    result = decode_tensors(api.call("GET", "/v1/weights").data)
    assert all(torch.equal(t, torch.full_like(t, 15.0)) for t in result.values())
    (progress,) = api.ok("GET", "/v1/datasets")["datasets"]
    assert (progress["completed"], progress["leased"], progress["free"]) == (3, 0, 7)


def test_a_bad_units_list_is_refused_before_the_body_is_read(served) -> None:
    api, server = served
    before = snapshot(api)
    announced = len(gradient(-8.0))
    for units in ("a,b", "1,,2", "-1"):
        status, _, data, elapsed = raw_request(
            api.url,
            "POST",
            f"/v1/rounds/0/submissions?worker_id=w1&units={units}",
            {"Content-Type": "application/octet-stream", "Content-Length": str(announced)},
            b"\x08\x00",  # two bytes of the announced body, and then nothing
        )
        body = check_error(status, data, 422, "invalid_request", "'units'")
        assert body["detail"]["field"] == "units"
        assert elapsed < 3.0, f"the 422 took {elapsed:.1f} s: the server waited for the body?"
    assert snapshot(api) == before
    current = server.coordinator.round
    assert current.submitted == {} and current.units == {} and current.running is None
    assert server.coordinator.traffic.bytes_in == 0


def test_a_submission_with_units_it_does_not_hold_is_not_folded(served) -> None:
    api, server = served
    before = snapshot(api)
    refused = _units("1")(api)
    check_error(refused.status, refused.data, 422, "unit_not_leased", "'w0'")
    assert snapshot(api) == before
    assert server.coordinator.round.submitted == {}
    assert api.ok("GET", "/v1/status")["waiting_for"] == ["w0", "w1"]
    # The same worker resubmits with what it holds: accepted and counted once.
    accepted = api.submit("w1", gradient(-8.0), 0, "&units=3").json()
    assert accepted == {
        "status": "accepted",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["w0"],
    }
    assert server.coordinator.round.units == {"w1": [3]}


def test_a_duplicate_s_units_still_held_complete_with_the_round(served) -> None:
    """w0's first body reports unit 1; its sync then fails on its side, it trains on and sends
    round 0 again, reporting units 1 and 2: "duplicate" (the round folded its first body), and
    the worker counts both as reported. Unit 2 went nowhere and stayed leased to w0 for good,
    never trained again; now it goes with the round and completes when it commits (unit 1
    once), as a late submission's units do."""
    api, server = served
    assert api.submit("w0", gradient(-2.0), 0, "&units=1").json()["status"] == "accepted"
    again = api.submit("w0", gradient(-4.0), 0, "&units=1,2").json()
    assert again["status"] == "duplicate"
    assert server.coordinator.round.units == {"w0": [1, 2]}
    assert api.submit("w1", gradient(-8.0), 0, "&units=3").json()["current_round"] == 1
    (dataset,) = api.ok("GET", "/v1/datasets")["datasets"]
    assert (dataset["completed"], dataset["leased"], dataset["free"]) == (3, 0, 7)
    completions = server.coordinator.data_leases.pool.completions("ds")
    assert sorted(c["unit_id"] for c in completions) == [1, 2, 3]
    # the duplicate's body was not used: 10 - mean(-2, -8) with SGD at lr 1, by hand (its
    # -4 would have made 10 - mean(-4, -8) = 16)
    weights = decode_tensors(api.call("GET", "/v1/weights").data)
    assert all(torch.all(t == 15.0) for t in weights.values())


# -- progress ---------------------------------------------------------------------------------


def test_datasets_report_progress_per_dataset_and_epoch(served) -> None:
    api, _ = served
    progress = api.ok("GET", "/v1/datasets")
    assert progress == {
        "datasets": [
            {"dataset_id": "ds", "epoch": 0, "total": 10, "completed": 0, "leased": 3, "free": 7}
        ]
    }
    # A second dataset, and the same registration again (idempotent: the same answer).
    small = {"worker_id": "w1", "dataset_id": "small", "length": 5, "unit_size": 2}
    assert api.ok("POST", "/v1/datasets", json_body=small)["units_per_epoch"] == 3
    assert api.ok("POST", "/v1/datasets", json_body=small)["units_per_epoch"] == 3
    lease = api.ok("POST", "/v1/datasets/small/leases", json_body={"worker_id": "w1", "count": 5})
    assert [len(u["indices"]) for u in lease["units"]] == [2, 2, 1]
    order = Permutation(5, 0, 0)
    assert [i for u in lease["units"] for i in u["indices"]] == [order(p) for p in range(5)]
    exhausted = api.ok("POST", "/v1/datasets/small/leases", json_body={"worker_id": "w1"})
    assert exhausted == {"status": "exhausted", "dataset_id": "small", "epoch": 0, "units": []}
    opened = api.ok(
        "POST", "/v1/datasets/small/leases", json_body={"worker_id": "w1", "next_epoch": True}
    )
    assert opened["epoch"] == 1 and [u["epoch"] for u in opened["units"]] == [1]

    # Round 0 completes w0's units 1, 2 and w1's 4, 5, 6 (all of small's epoch 0).
    api.submit("w0", gradient(-2.0), 0, "&units=1,2")
    api.submit("w1", gradient(-8.0), 0, "&units=4,5,6")
    datasets = api.ok("GET", "/v1/datasets")["datasets"]
    rows = [(d["dataset_id"], d["epoch"], d["total"], d["completed"], d["leased"], d["free"])
            for d in datasets]  # fmt: skip
    assert rows == [
        ("ds", 0, 10, 2, 1, 7),
        ("small", 0, 3, 3, 0, 0),
        ("small", 1, 3, 0, 1, 2),
    ]
    assert api.ok("GET", "/v1/status")["datasets"] == datasets


# -- auth -------------------------------------------------------------------------------------


def test_the_data_routes_need_the_token(live_server) -> None:
    with live_server(SETTINGS, state(10.0), TOKEN) as server:
        enrolled = Api(server.url, TOKEN)
        api = Api(server.url, enrolled.register("w0")["credential"])  # w0's own credential
        requests = [
            ("POST", "/v1/datasets", DATASET),
            ("GET", "/v1/datasets", None),
            ("POST", LEASES, {"worker_id": "w0", "count": 1}),
            ("POST", "/v1/datasets/nope/leases", {"worker_id": "w0"}),
        ]
        for authorization in (None, "Bearer wrong-token", TOKEN, f"Basic {TOKEN}"):
            anonymous = Api(server.url)
            for method, path, message in requests:
                response = anonymous.pool.request(
                    method,
                    path,
                    body=None if message is None else json.dumps(message).encode(),
                    headers={} if authorization is None else {"Authorization": authorization},
                )
                check_error(response.status, response.data, 401, "unauthorized", "token")
                assert response.headers["WWW-Authenticate"] == 'Bearer realm="diloco"'
            response = anonymous.call(
                "POST", "/v1/rounds/0/submissions?worker_id=w0&units=1", body=gradient(-2.0)
            )
            check_error(response.status, response.data, 401, "unauthorized")
        assert api.ok("GET", "/v1/datasets") == {"datasets": []}  # nothing was registered

        assert api.ok("POST", "/v1/datasets", json_body=DATASET)["units_per_epoch"] == 10
        leased = api.ok("POST", LEASES, json_body={"worker_id": "w0", "lease_key": "k" * 8})
        again = api.ok("POST", LEASES, json_body={"worker_id": "w0", "lease_key": "k" * 8})
        assert leased == again and [u["unit_id"] for u in leased["units"]] == [1]
        answer = api.ok(
            "POST", "/v1/rounds/0/submissions?worker_id=w0&units=1", body=gradient(-2.0)
        )
        assert answer["current_round"] == 1
        (progress,) = api.ok("GET", "/v1/datasets")["datasets"]
        assert (progress["completed"], progress["leased"]) == (1, 0)
        assert server.coordinator.pool.completions()[0]["round"] == 0
