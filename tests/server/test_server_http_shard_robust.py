"""Robust aggregation on sync sharded servers over raw HTTP (issue 28, item 1): shard 0
screens each worker's whole pseudo-gradient from every shard's part of its sums, and every
shard folds its slices as that verdict says, as one server would.

Layout and outer step as in test_server_http_shards.py: a (4 values) on shard 0, b (2) and c
(1) on shard 1; nesterov lr 0.5, mu 0.9, first step G -= 0.95 g. Five workers; every one
sends a = [1, 0, 0, 0] and c = [0], and b:

    w1 [1, 0]   w2 [0, 1]   w3 [1, 1]   w4 [-3, -3]   w5 [4, 4]

Whole norms (squares over a, b, c): 2, 2, 3, 19, 33 -> sqrt 1.414, 1.414, 1.732, 4.359,
5.745; their median (no history yet) 1.732 = sqrt(3), 10x of it refuses none. Element-wise
median of the five: a [1, 0, 0, 0], b [1, 1] (b0: -3 0 1 1 4; b1: -3 0 1 1 4), c [0]. Dots
with it: w1 2, w2 2, w3 3, w4 1 - 6 = -5, w5 9: w4 points away and is refused, though its
part on shard 0 alone (a: dot 1) points along, so shard 0 could not refuse it by itself.
clipped_mean clips w5 to 2 x sqrt(3) / sqrt(33) = 2 / sqrt(11) = s, though its part on
shard 0 alone has norm 1.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import pytest
import torch
from test_server_http_shards import (
    INITIAL,
    OWNED,
    call,
    json_of,
    register,
    started_shards,
    submit,
    wait_version,
    weights,
)

from diloco.server.coordinator import Coordinator

WORKERS = ("w1", "w2", "w3", "w4", "w5")
B = {"w1": [1.0, 0.0], "w2": [0.0, 1.0], "w3": [1.0, 1.0], "w4": [-3.0, -3.0], "w5": [4.0, 4.0]}
S = 2 / math.sqrt(11)  # w5's clip scale


def gradient(worker: str) -> dict[str, torch.Tensor]:
    return {
        "a": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        "b": torch.tensor(B[worker]),
        "c": torch.tensor([0.0]),
    }


def send_every_slice(url0: str, url1: str) -> None:
    for worker in WORKERS:
        register([url0, url1], worker)
    for worker in WORKERS:
        for url, names in zip((url0, url1), OWNED, strict=True):
            status, data = submit(url, worker, {n: gradient(worker)[n] for n in names})
            assert status == 200, data
    for worker in WORKERS:
        status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id=worker)
        assert status == 200, data


# the step's g, worked out above: clipped_mean averages w1, w2, w3 and s w5 (4 kept);
# median takes the element-wise median of w1, w2, w3, w5 (a0: 1 1 1 1; b0: 0 1 1 4 -> 1;
# b1: 0 1 1 4 -> 1)
STEP = {
    "clipped_mean": {"a": [(3 + S) / 4, 0, 0, 0], "b": [0.5 + S, 0.5 + S], "c": [0.0]},
    "median": {"a": [1.0, 0, 0, 0], "b": [1.0, 1.0], "c": [0.0]},
}


@pytest.fixture(params=["clipped_mean", "median"])
def robust_shards(request) -> Iterator[tuple[str, list[tuple[str, Coordinator]]]]:
    for shards in started_shards(None, aggregation=request.param):
        yield request.param, shards


def test_sync_shards_screen_each_whole_pseudo_gradient_as_one_server(robust_shards) -> None:
    rule, ((url0, _), (url1, follower)) = robust_shards
    send_every_slice(url0, url1)
    wait_version(follower, 1)
    got0, _ = weights(url0)
    got1, _ = weights(url1)
    for name, tensor in {**got0, **got1}.items():
        expected = INITIAL[name] - 0.95 * torch.tensor(STEP[rule][name])
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
    decision = json_of(call(url0, "GET", "/v1/shard/decisions/0"))
    assert decision["contributors"] == list(WORKERS)  # w4 keeps its barrier place
    scales = {"w1": 1.0, "w2": 1.0, "w3": 1.0, "w4": 0.0, "w5": S if rule == "clipped_mean" else 1}
    assert decision["scales"] == pytest.approx(scales, rel=1e-12)
    squares = {"w1": 2, "w2": 2, "w3": 3, "w5": 33}
    assert decision["norms"] == pytest.approx({w: math.sqrt(q) for w, q in squares.items()})
    # shard 1 records the step as shard 0 decided it (its audit log names the refusal)
    assert follower.journal.state.screened_of(0) == (
        pytest.approx(scales, rel=1e-12),
        pytest.approx({w: math.sqrt(q) for w, q in squares.items()}),
    )


@pytest.fixture
def median_shards_unfollowed() -> Iterator[list[tuple[str, Coordinator]]]:
    yield from started_shards(None, follow=False, aggregation="median", barrier_timeout=2.0)


def test_shard_0_waits_for_every_part_and_refuses_a_bad_one(median_shards_unfollowed) -> None:
    """Shard 1 runs no decision loop: the test asks for the screening as it would and sends
    its part by hand. Shard 1's part over b and c (the kept w1, w2, w3, w4, w5; median b
    [1, 1], c [0]): dots w1 1, w2 1, w3 2, w4 -6, w5 8; squares 1, 1, 2, 18, 32; the
    median's squares 2. Shard 0's own part (a): dots 1 each, squares 1 each, median 1."""
    (url0, leader), (url1, _) = median_shards_unfollowed
    first_sent = time.monotonic()
    send_every_slice(url0, url1)
    asked = json_of(call(url0, "GET", "/v1/shard/decisions/0", shard=1))
    assert asked["status"] == "screening" and asked["answered"] == [0]
    kept = asked["kept"]
    assert sorted(kept) == list(WORKERS)
    assert leader.version == 0  # nothing steps before shard 1's part is in
    # past the barrier timeout (2 s): every member is in, so the poll waits, it is no 504
    time.sleep(max(0.0, first_sent + 2.2 - time.monotonic()))
    status, data = call(url0, "GET", "/v1/rounds/0/result", worker_id="w1", wait=0)
    assert status == 202, data

    def post(body: dict, round_number: int = 0) -> tuple:
        text = json.dumps(body).encode()
        return call(url0, "POST", f"/v1/shard/screening/{round_number}", text)

    part = {
        "shard": 1,
        "kept": kept,
        "dots": {"w1": 1.0, "w2": 1.0, "w3": 2.0, "w4": -6.0, "w5": 8.0},
        "squares": {"w1": 1.0, "w2": 1.0, "w3": 2.0, "w4": 18.0, "w5": 32.0},
        "median_squares": 2.0,
    }
    bad = [
        ({**part, "shard": 0}, 422, "invalid_request"),
        ({**part, "shard": 2}, 422, "invalid_request"),
        ({**part, "kept": {**kept, "w4": "0" * 16}}, 409, "screening_changed"),
        ({**part, "dots": {"w1": 1.0}}, 422, "invalid_request"),
        ({**part, "squares": {"w1": 1.0}}, 422, "invalid_request"),
        ({**part, "dots": {**part["dots"], "w1": "1.0"}}, 422, "invalid_request"),
        ({**part, "squares": {**part["squares"], "w1": -1.0}}, 422, "invalid_request"),
        ({**part, "squares": {**part["squares"], "w1": True}}, 422, "invalid_request"),
        ({**part, "median_squares": "two"}, 422, "invalid_request"),
        ({**part, "missing": ["w9"]}, 422, "invalid_request"),
    ]
    for body, code, kind in bad:
        status, data = post(body)
        assert status == code, (body, data)
        assert json.loads(data)["kind"] == kind, data
    status, data = post({**part, "squares": {"w1": 1.0}})
    assert json.loads(data)["detail"]["field"] == "squares", data  # the field that is wrong
    text = json.dumps({**part, "median_squares": 0.5}).replace("0.5", "Infinity").encode()
    status, data = call(url0, "POST", "/v1/shard/screening/0", text)
    assert status == 422 and "median_squares" in json.loads(data)["error"], data
    status, data = post(part, round_number=1)
    assert status == 409 and json.loads(data)["kind"] == "screening_changed", data
    assert leader.version == 0  # no bad part moved anything
    # shard 1 lost w2's slice (a restart): it says so, and w2's result poll on shard 0 tells
    # it to send its slices again; the others wait
    status, data = post({**part, "dots": {}, "squares": {}, "missing": ["w2"]})
    assert status == 200 and json.loads(data)["status"] == "missing", data
    status, data = call(url0, "GET", "/v1/rounds/0/result", worker_id="w2", wait=0)
    assert status == 409, data
    lost = json.loads(data)
    assert lost["kind"] == "not_submitted" and lost["detail"]["shards"] == [1], lost
    status, data = call(url0, "GET", "/v1/rounds/0/result", worker_id="w1", wait=0)
    assert status == 202, data
    # w2 sends its slices again and confirms: every shard holds them, so it is told no more
    for url, names in zip((url0, url1), OWNED, strict=True):
        status, data = submit(url, "w2", {n: gradient("w2")[n] for n in names})
        assert status == 200, data
    status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2")
    assert status == 200, data
    status, data = call(url0, "GET", "/v1/rounds/0/result", worker_id="w2", wait=0)
    assert status == 202, data
    status, data = post(part)
    assert status == 200 and json.loads(data)["status"] == "taken", data
    wait_version(leader, 1)
    got0, _ = weights(url0)
    torch.testing.assert_close(got0["a"], torch.tensor([1.0 - 0.95, 2.0, 3.0, 4.0]))
    decision = json_of(call(url0, "GET", "/v1/shard/decisions/0", shard=1))
    assert decision["status"] == "decided" and decision["scales"]["w4"] == 0.0
    status, data = call(url0, "GET", "/v1/rounds/0/result", worker_id="w2", wait=0)
    assert status == 200, data  # its part is in: nothing is missing any more
