"""Async mode across sharded servers over raw HTTP: two shard coordinators behind real uvicorn,
in threads, each with its own state dir (its `submissions` table is read with sqlite3).

The layout is test_server_http_shards.py's: a (16 B) -> shard 0, b and c -> shard 1. A worker
sends each shard its slice of an arrival for its anchor version, then confirms on shard 0.

Expected weights are worked out by hand from Delayed Nesterov (Liu et al. 2024, Algorithm 3;
docs/architecture.md, "The math, with signs"), per name, arrival (step) t, period N:
D += g; if t mod N != 0: theta -= lr (c beta m + g / N); else m = beta m + D / N,
theta -= lr ((1 - c (N - 1)) beta m + g / N), D = 0. With N = 1 that is Nesterov:
m = beta m + g, theta -= lr (beta m + g). A window's g is the mean of its arrivals, each
scaled by 1 / sqrt(1 + staleness) under inverse_sqrt. Every run here has lr 1, beta 0.5.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from test_server_http_shards import (
    HTTP,
    INITIAL,
    OWNED,
    call,
    json_of,
    register,
    serve_in_thread,
    started_shards,
    wait_version,
    weights,
)

from diloco.server.coordinator import Coordinator
from diloco.server.ops.launch import free_ports
from diloco.server.settings import ServerSettings
from diloco.server.shards.peers import DecisionFollower, ShardPeers
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore

NAMES = ["a", "b", "c"]
LR, BETA = 1.0, 0.5
G = {  # pseudo-gradients (anchor - local), small multiples of 2: the sums below stay exact
    "w1": {"a": torch.tensor([2.0, 0.0, -2.0, 4.0]), "b": torch.tensor([4.0, 8.0]),
           "c": torch.tensor([2.0])},
    "w2": {"a": torch.tensor([6.0, 4.0, 2.0, 0.0]), "b": torch.tensor([0.0, -8.0]),
           "c": torch.tensor([-6.0])},
    "w3": {"a": torch.tensor([-2.0, 2.0, 0.0, 2.0]), "b": torch.tensor([2.0, 2.0]),
           "c": torch.tensor([4.0])},
}  # fmt: skip
Tensors = dict[str, torch.Tensor]
# One step (N = 1) of the window of w1 and w2 from INITIAL, by hand: g = (g1 + g2) / 2 =
# a [4, 2, 0, 2], b [2, 0], c [-2]; theta -= 1.5 g: a [1 - 6, 2 - 3, 3, 4 - 3],
# b [10 - 3, -10], c [0.5 + 3]
MEAN_OF_W1_W2_STEP = {
    "a": torch.tensor([-5.0, -1.0, 3.0, 1.0]),
    "b": torch.tensor([7.0, -10.0]),
    "c": torch.tensor([3.5]),
}


@dataclass
class Shard:
    url: str
    coordinator: Coordinator
    state_dir: Path


@contextlib.contextmanager
def async_shards(root: Path, **overrides) -> Iterator[list[Shard]]:
    """Two async shards (shard 1 follows shard 0's decisions with a DecisionFollower, as in
    test_server_http_shards.py), each with a state dir under `root`."""
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shards, servers, threads, followers, peers_of = [], [], [], [], []
    try:
        for index, port in enumerate(ports):
            settings = ServerSettings(
                mode="async",
                outer_optimizer="nesterov",
                outer_lr=LR,
                outer_momentum=BETA,
                shard=index,
                shard_urls=tuple(urls),
                **overrides,
            )
            state_dir = root / f"shard-{index}"
            journal = RoundJournal(StateStore(state_dir), settings)
            initial = {name: INITIAL[name].clone() for name in OWNED[index]}
            peers = ShardPeers(urls, index, None)
            peers_of.append(peers)
            coordinator = Coordinator(settings, initial, journal=journal, peers=peers)
            server, thread = serve_in_thread(coordinator, port, None)
            servers.append(server)
            threads.append(thread)
            if index:
                shard = coordinator.shard
                assert shard is not None
                follower = DecisionFollower(peers, shard, wait=1)
                follower.start()
                followers.append(follower)
            shards.append(Shard(urls[index], coordinator, state_dir))
        yield shards
    finally:
        for follower in followers:
            follower.stop()
        for server in servers:
            server.should_exit = True
        for thread in [*threads, *followers]:
            thread.join(timeout=15)
        for peers in peers_of:
            peers.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., list[Shard]]]:
    """`start(dn_period=2, ...)`: two async shards with these settings; stopped after."""
    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(async_shards(tmp_path, **overrides))


# ----------------------------------------------------------------- calls


def send_slice(url: str, worker_id: str, anchor: int, tensors: Tensors, tokens: int = 0) -> dict:
    path = f"/v1/rounds/{anchor}/submissions"
    status, data = call(url, "POST", path, save(tensors), worker_id=worker_id, tokens=tokens)
    assert status == 200, data
    return json.loads(data)


def send_slices(
    shards: list[Shard], worker_id: str, anchor: int, g: Tensors, tokens: int = 0
) -> None:
    """The worker's slice of its arrival to every shard (a to shard 0, b and c to shard 1),
    each with the same token count."""
    for shard, owned in zip(shards, OWNED, strict=True):
        answer = send_slice(shard.url, worker_id, anchor, {n: g[n] for n in owned}, tokens)
        assert answer["status"] == "accepted", answer


def confirm(shard0: Shard, worker_id: str, anchor: int) -> tuple[int, dict]:
    status, data = call(shard0.url, "POST", f"/v1/rounds/{anchor}/confirm", worker_id=worker_id)
    return status, json.loads(data)


def arrive(shards: list[Shard], worker_id: str, anchor: int, g: Tensors) -> dict:
    """Send every slice, confirm on shard 0 (200), and return the confirmation."""
    send_slices(shards, worker_id, anchor, g)
    status, answer = confirm(shards[0], worker_id, anchor)
    assert status == 200, answer
    return answer


def at_version(shards: list[Shard], version: int) -> None:
    for shard in shards:
        wait_version(shard.coordinator, version)
    assert [s.coordinator.version for s in shards] == [version] * len(shards)


def whole_model(shards: list[Shard], version: int) -> Tensors:
    """Every shard's current weights over HTTP, each stating `version`; shards own theirs."""
    model: Tensors = {}
    for shard, owned in zip(shards, OWNED, strict=True):
        got, round_number = weights(shard.url)
        assert round_number == version, shard.url
        assert sorted(got) == owned
        model.update(got)
    return model


def assert_model(got: Tensors, expected: Tensors) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)


def exact_weights(url: str, version: int) -> tuple[int, bytes, int | None]:
    """GET /v1/weights?version=V: (status, body, the X-Diloco-Round header)."""
    response = HTTP.request("GET", f"{url}/v1/weights?version={version}")
    header = response.headers.get("X-Diloco-Round")
    return response.status, response.data, None if header is None else int(header)


def result(url: str, anchor: int, worker_id: str, **fields) -> tuple[int, bytes, int | None]:
    query = "&".join(f"{k}={v}" for k, v in {"worker_id": worker_id, **fields}.items())
    response = HTTP.request("GET", f"{url}/v1/rounds/{anchor}/result?{query}")
    header = response.headers.get("X-Diloco-Round")
    return response.status, response.data, None if header is None else int(header)


def refusal(status: int, body: bytes | dict, expected_status: int, kind: str) -> dict:
    """The error body's detail, once status and kind are as expected."""
    assert status == expected_status, body
    if isinstance(body, bytes):
        body = json.loads(body)
    assert body["kind"] == kind, body
    return body["detail"]


def decision(shard0: Shard, version: int) -> dict:
    """The decision, its `sessions` (each contributor's session digest: these workers
    registered without a session, so sha256 of "" cut to 16 hex digits) checked and left out."""
    answer = json_of(call(shard0.url, "GET", f"/v1/shard/decisions/{version}"))
    if answer.get("status") == "decided":
        sessions = answer.pop("sessions")
        assert sessions == {w: "e3b0c44298fc1c14" for w in answer["contributors"]}, sessions
    return answer


def rows(shard: Shard, query: str) -> list[tuple]:
    """Rows of the shard's state.sqlite, read by a connection of our own."""
    uri = f"file:{shard.state_dir / 'state.sqlite'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
        return [tuple(row) for row in db.execute(query).fetchall()]


def submissions(shard: Shard) -> list[tuple]:
    """(worker, round sent for, version of the step that used it, staleness), by version."""
    return rows(
        shard,
        "SELECT worker_id, round, version, staleness FROM submissions ORDER BY version, worker_id",
    )


def steps(shard: Shard) -> list[tuple]:
    """(version, contributors as JSON, tokens) of each outer step in the `rounds` table."""
    return rows(shard, "SELECT round, contributors, tokens FROM rounds ORDER BY round")


def of(model: Tensors, names: list[str]) -> Tensors:
    return {n: model[n] for n in names}


# ----------------------------------------------------------------- tests


def test_a_slice_missing_on_shard_1_is_not_prepared_and_nothing_moves(start) -> None:
    shards = start()
    shard0, shard1 = shards
    register([shard0.url, shard1.url], "w1")
    send_slice(shard0.url, "w1", 0, {"a": G["w1"]["a"]})  # shard 1 never got its slice
    status, answer = confirm(shard0, "w1", 0)
    detail = refusal(status, answer, 409, "not_prepared")
    assert detail["shards"] == [1]
    assert (detail["round"], detail["worker_id"]) == (0, "w1")
    time.sleep(0.3)
    assert [s.coordinator.version for s in shards] == [0, 0]
    assert_model(whole_model(shards, 0), INITIAL)
    assert decision(shard0, 0) == {"status": "waiting", "round": 0}
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == []  # no window

    answer = send_slice(shard1.url, "w1", 0, {n: G["w1"][n] for n in ("b", "c")})
    assert answer["status"] == "accepted" and answer["applied_version"] is None
    status, answer = confirm(shard0, "w1", 0)
    assert status == 200, answer
    assert answer["status"] == "accepted"
    assert (answer["applied_version"], answer["staleness"]) == (0, 0)  # its own step, at once
    at_version(shards, 1)
    # N = 1: m = g, theta -= 1 * (0.5 g + g) = theta - 1.5 g
    # a [1 - 3, 2, 3 + 3, 4 - 6], b [10 - 6, -10 - 12], c [0.5 - 3]
    expected = {
        "a": torch.tensor([-2.0, 2.0, 6.0, -2.0]),
        "b": torch.tensor([4.0, -22.0]),
        "c": torch.tensor([-2.5]),
    }
    assert_model(whole_model(shards, 1), expected)
    assert decision(shard0, 0) == {
        "status": "decided",
        "round": 0,
        "contributors": ["w1"],
        "anchors": {"w1": 0},
    }


def test_delayed_nesterov_steps_alike_on_every_shard(start) -> None:
    """N = 2, c = 0.5 (in [0, 1/(N-1)] = [0, 1]); three arrivals, each its own step:
    w1@0 (staleness 0), w2@0 (staleness 1), w1@1 (staleness 1); no staleness weighting."""
    shards = start(dn_period=2, dn_c=0.5)
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    g1, g2, g3 = G["w1"], G["w2"], G["w3"]
    theta0 = INITIAL
    c, n = 0.5, 2

    answer = arrive(shards, "w1", 0, g1)
    assert (answer["applied_version"], answer["staleness"]) == (0, 0)
    at_version(shards, 1)
    # t = 1 (odd): m = 0, theta1 = theta0 - lr (c beta 0 + g1 / 2) = theta0 - g1 / 2
    theta1 = {k: theta0[k] - LR * (g1[k] / n) for k in NAMES}
    assert_model(whole_model(shards, 1), theta1)
    assert_model(  # by hand: a [1 - 1, 2, 3 + 1, 4 - 2], b [10 - 2, -10 - 4], c [0.5 - 1]
        theta1,
        {
            "a": torch.tensor([0.0, 2.0, 4.0, 2.0]),
            "b": torch.tensor([8.0, -14.0]),
            "c": torch.tensor([-0.5]),
        },
    )

    answer = arrive(shards, "w2", 0, g2)
    assert (answer["applied_version"], answer["staleness"]) == (1, 1)
    at_version(shards, 2)
    # t = 2: D = g1 + g2, m = beta 0 + D / 2, theta2 = theta1 - lr ((1 - c) beta m + g2 / 2)
    m = {k: (g1[k] + g2[k]) / n for k in NAMES}
    theta2 = {k: theta1[k] - LR * ((1 - c * (n - 1)) * BETA * m[k] + g2[k] / n) for k in NAMES}
    assert_model(whole_model(shards, 2), theta2)
    # a: m = [4, 2, 0, 2], theta2 = [0, 2, 4, 2] - (0.25 m + [3, 2, 1, 0]) = [-4, -0.5, 3, 1.5]
    torch.testing.assert_close(theta2["a"], torch.tensor([-4.0, -0.5, 3.0, 1.5]))

    answer = arrive(shards, "w1", 1, g3)  # w1 again, from version 1 (its result's)
    assert (answer["applied_version"], answer["staleness"]) == (2, 1)
    at_version(shards, 3)
    # t = 3 (odd): D = g3, theta3 = theta2 - lr (c beta m + g3 / 2), m unchanged
    theta3 = {k: theta2[k] - LR * (c * BETA * m[k] + g3[k] / n) for k in NAMES}
    assert_model(whole_model(shards, 3), theta3)
    # c: m = (2 - 6) / 2 = -2; theta2 = -0.5 - (0.25 (-2) + (-3)) = 3; theta3 = 3 - (-0.5 + 2)
    torch.testing.assert_close(theta3["c"], torch.tensor([1.5]))

    expected = [("w1", 0, 0, 0), ("w2", 0, 1, 1), ("w1", 1, 2, 1)]
    for version, (worker, anchor, _, _) in enumerate(expected):
        assert decision(shard0, version) == {
            "status": "decided",
            "round": version,
            "contributors": [worker],
            "anchors": {worker: anchor},
        }
    assert submissions(shard0) == expected
    assert submissions(shard1) == expected


def test_a_stale_arrival_is_scaled_alike_on_every_shard(start) -> None:
    """inverse_sqrt: w2's arrival from version 0 lands at version 1 (staleness 1): its
    pseudo-gradient is scaled by 1 / sqrt(1 + 1) on both shards."""
    shards = start(staleness_weighting="inverse_sqrt")
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    g1 = G["w1"]
    arrive(shards, "w1", 0, g1)
    at_version(shards, 1)
    send_slices(shards, "w2", 0, G["w2"])  # anchored at 0, now at 1
    status, answer = confirm(shard0, "w2", 0)
    assert status == 200, answer
    assert (answer["applied_version"], answer["staleness"]) == (1, 1)
    at_version(shards, 2)
    # N = 1, step 1: m1 = g1, theta1 = theta0 - (0.5 g1 + g1) = theta0 - 1.5 g1
    # step 2: g = g2 / sqrt(2), m2 = 0.5 m1 + g, theta2 = theta1 - (0.5 m2 + g)
    scale = 1 / math.sqrt(1 + 1)
    g = {k: G["w2"][k] * scale for k in NAMES}
    theta1 = {k: INITIAL[k] - 1.5 * g1[k] for k in NAMES}
    m2 = {k: BETA * g1[k] + g[k] for k in NAMES}
    theta2 = {k: theta1[k] - LR * (BETA * m2[k] + g[k]) for k in NAMES}
    assert_model(whole_model(shards, 2), theta2)
    # b[1] by hand: theta1 = -10 - 12 = -22; g = -8 / sqrt 2; theta2 = -22 - 2 + 1.5 * 8/sqrt 2
    assert theta2["b"][1].item() == pytest.approx(-24.0 + 12.0 / math.sqrt(2), abs=1e-5)
    assert decision(shard0, 1)["anchors"] == {"w2": 0}
    expected = [("w1", 0, 0, 0), ("w2", 0, 1, 1)]
    assert submissions(shard0) == expected
    assert submissions(shard1) == expected


def test_a_grace_window_of_two_arrivals_is_one_step_of_their_mean(start) -> None:
    shards = start(grace_seconds=30.0)
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    first = arrive(shards, "w1", 0, G["w1"])
    assert first["status"] == "accepted" and first["applied_version"] is None
    assert first["waiting_for"] == ["w2"]  # the window stays open for the other live worker
    time.sleep(0.3)
    assert [s.coordinator.version for s in shards] == [0, 0]
    status, data, _ = result(shard0.url, 0, "w1", wait=0)
    assert status == 202 and json.loads(data)["status"] == "waiting"

    second = arrive(shards, "w2", 0, G["w2"])
    assert second["applied_version"] == 0  # both arrived: the window closed early
    at_version(shards, 1)
    assert_model(whole_model(shards, 1), MEAN_OF_W1_W2_STEP)
    assert decision(shard0, 0) == {
        "status": "decided",
        "round": 0,
        "contributors": ["w1", "w2"],
        "anchors": {"w1": 0, "w2": 0},
    }
    for shard in shards:
        assert submissions(shard) == [("w1", 0, 0, 0), ("w2", 0, 0, 0)]
    status, data, round_number = result(shard0.url, 0, "w1", wait=5)
    assert (status, round_number) == (200, 1)
    assert_model(load(data), of(MEAN_OF_W1_W2_STEP, ["a"]))


# One worker, the same g every time (N = 1): m_k = 0.5 m_k-1 + g = g, 1.5 g, 1.75 g, 1.875 g,
# 1.9375 g and theta_k = theta_k-1 - (0.5 m_k + g), so theta_k = theta0 - TOTALS[k] g with
# TOTALS = 0, 1.5, 1.5 + 1.75, 3.25 + 1.875, 5.125 + 1.9375, 7.0625 + 1.96875.
TOTALS = (0.0, 1.5, 3.25, 5.125, 7.0625, 9.03125)


def theta(version: int, names: list[str]) -> Tensors:
    return {k: INITIAL[k] - TOTALS[version] * G["w1"][k] for k in names}


def test_a_follower_serves_exact_versions(start) -> None:
    """Five steps of w1's; shard 1 serves exactly the version asked for while it keeps it."""
    shards = start()
    shard0, shard1 = shards
    register([shard0.url, shard1.url], "w1")
    g = G["w1"]
    arrive(shards, "w1", 0, g)
    at_version(shards, 1)
    status, data, round_number = exact_weights(shard1.url, 1)  # the current one
    assert (status, round_number) == (200, 1), data
    assert_model(load(data), theta(1, ["b", "c"]))
    detail = refusal(*exact_weights(shard1.url, 2)[:2], 409, "future_round")
    assert detail["current_round"] == 1
    status, data, round_number = exact_weights(shard0.url, 1)  # shard 0 serves its current
    assert (status, round_number) == (200, 1), data
    assert_model(load(data), theta(1, ["a"]))

    for anchor in (1, 2, 3):
        arrive(shards, "w1", anchor, g)
        at_version(shards, anchor + 1)

    # the last arrival, w1@4: a poll for exactly version 5 on shard 1 waits for it
    send_slice(shard1.url, "w1", 4, {n: g[n] for n in ("b", "c")})
    status, data, _ = result(shard1.url, 4, "w1", version=5, wait=0)
    assert status == 202 and json.loads(data)["status"] == "waiting"
    polled: list[tuple] = []
    poll = threading.Thread(
        target=lambda: polled.append(result(shard1.url, 4, "w1", version=5, wait=20))
    )
    poll.start()
    time.sleep(0.2)
    send_slice(shard0.url, "w1", 4, {"a": g["a"]})
    status, answer = confirm(shard0, "w1", 4)
    assert status == 200, answer
    poll.join(timeout=30)
    assert not poll.is_alive()
    status, data, round_number = polled[0]
    assert (status, round_number) == (200, 5), data
    assert_model(load(data), theta(5, ["b", "c"]))
    at_version(shards, 5)

    assert_model(whole_model(shards, 5), theta(5, NAMES))
    for version in (5, 4, 3):  # the current one, then kept ones
        status, data, round_number = exact_weights(shard1.url, version)
        assert (status, round_number) == (200, version), data
        assert_model(load(data), theta(version, ["b", "c"]))
    for version in (1, 0):  # 4 and 5 versions behind: gone
        detail = refusal(*exact_weights(shard1.url, version)[:2], 409, "version_gone")
        assert (detail["version"], detail["current_round"]) == (version, 5)
    detail = refusal(*exact_weights(shard1.url, 6)[:2], 409, "future_round")
    assert detail["current_round"] == 5

    # the result route: w1@2 was applied by step 2 -> 3; exactly version 4 is a kept one
    status, data, round_number = result(shard1.url, 2, "w1", version=4, wait=0)
    assert (status, round_number) == (200, 4), data
    assert_model(load(data), theta(4, ["b", "c"]))
    detail = refusal(*result(shard1.url, 0, "w1", version=1, wait=0)[:2], 409, "version_gone")
    assert (detail["version"], detail["current_round"]) == (1, 5)
    status, data, _ = result(shard1.url, 4, "w1", version=6, wait=0)  # not reached: waits
    assert status == 202 and json.loads(data)["status"] == "waiting"
    assert [s.coordinator.version for s in shards] == [5, 5]


def test_a_follower_keeps_a_version_until_it_is_more_than_3_past_it(start) -> None:
    """docs/protocol.md: `version_gone` "when it has moved more than 3 versions past V". So
    after one step the initial version 0 is still served (a worker that took shard 0's
    version 0 just before the step), and after four steps version 1 still is (3 past)."""
    shards = start()
    shard0, shard1 = shards
    register([shard0.url, shard1.url], "w1")
    arrive(shards, "w1", 0, G["w1"])
    at_version(shards, 1)
    status, data, round_number = exact_weights(shard1.url, 0)
    assert (status, round_number) == (200, 0), data
    assert_model(load(data), theta(0, ["b", "c"]))
    for anchor in (1, 2, 3):
        arrive(shards, "w1", anchor, G["w1"])
        at_version(shards, anchor + 1)
    status, data, round_number = exact_weights(shard1.url, 1)
    assert (status, round_number) == (200, 1), data
    assert_model(load(data), theta(1, ["b", "c"]))
    detail = refusal(*exact_weights(shard1.url, 0)[:2], 409, "version_gone")
    assert (detail["version"], detail["current_round"]) == (0, 4)


@pytest.fixture
def sync_shards() -> Iterator[list]:
    yield from started_shards(None)


def test_version_is_only_for_async_shards(live_server, sync_shards) -> None:
    """One async server, and sync shards: `version` is 422 naming the field, on both routes."""
    single = ServerSettings(mode="async", outer_lr=LR, outer_momentum=BETA)
    with live_server(single, {n: t.clone() for n, t in INITIAL.items()}) as server:
        urls = [server.url, *(url for url, _ in sync_shards)]
        for url in urls:
            register([url], "w1")
            detail = refusal(*exact_weights(url, 0)[:2], 422, "invalid_request")
            assert detail["field"] == "version", url
            detail = refusal(*result(url, 0, "w1", version=0, wait=0)[:2], 422, "invalid_request")
            assert detail["field"] == "version", url
        assert server.coordinator.version == 0


def test_a_ban_leaves_a_confirmed_arrival_out_on_every_shard(start) -> None:
    """w1 and w2 confirm into a window that waits for w3; an admin bans w2 on shard 0; w3's
    arrival closes the window: the step is the mean of w1 and w3 on both shards, and its
    record (contributors, tokens: 100 + 300, not w2's 200) is the same on both."""
    shards = start(grace_seconds=30.0)
    shard0, shard1 = shards
    tokens = {"w1": 100, "w2": 200, "w3": 300}
    for worker in ("w1", "w2", "w3"):
        register([shard0.url, shard1.url], worker)
        send_slices(shards, worker, 0, G[worker], tokens[worker])
    for worker in ("w1", "w2"):
        status, answer = confirm(shard0, worker, 0)
        assert status == 200 and answer["applied_version"] is None, answer
    ban = json.dumps({"ban": True, "reason": "test"}).encode()
    status, data = call(shard0.url, "POST", "/v1/admin/workers/w2/evict", ban)
    assert status == 200, data
    assert json.loads(data)["pending_dropped"] is True
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == ["w3"]
    assert [s.coordinator.version for s in shards] == [0, 0]

    status, answer = confirm(shard0, "w3", 0)
    assert status == 200 and answer["applied_version"] == 0, answer
    at_version(shards, 1)
    # g = (g1 + g3) / 2: a [0, 1, -1, 3], b [3, 5], c [3]; N = 1: theta -= 1.5 g
    # a [1, 2 - 1.5, 3 + 1.5, 4 - 4.5], b [10 - 4.5, -10 - 7.5], c [0.5 - 4.5]
    expected = {
        "a": torch.tensor([1.0, 0.5, 4.5, -0.5]),
        "b": torch.tensor([5.5, -17.5]),
        "c": torch.tensor([-4.0]),
    }
    assert_model(whole_model(shards, 1), expected)
    assert decision(shard0, 0) == {
        "status": "decided",
        "round": 0,
        "contributors": ["w1", "w3"],
        "anchors": {"w1": 0, "w3": 0},
    }
    for shard in shards:
        assert submissions(shard) == [("w1", 0, 0, 0), ("w3", 0, 0, 0)]
    assert steps(shard1) == [(0, '["w1", "w3"]', 400)]
    assert steps(shard0) == [(0, '["w1", "w3"]', 400)]  # w2's 200 tokens are not the step's


def test_bad_requests_change_nothing(start) -> None:
    shards = start(grace_seconds=30.0)
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    send_slices(shards, "w1", 0, G["w1"])

    status, answer = confirm(shard0, "w1", 5)  # a version that does not exist yet
    detail = refusal(status, answer, 409, "future_round")
    assert detail["current_round"] == 0
    status, answer = confirm(shard0, "ghost", 0)
    detail = refusal(status, answer, 404, "unknown_worker")
    assert detail["worker_id"] == "ghost"
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == []  # no window

    status, answer = confirm(shard0, "w1", 0)
    assert (status, answer["status"], answer["applied_version"]) == (200, "accepted", None)
    status, answer = confirm(shard0, "w1", 0)  # again, while it waits in the window
    assert (status, answer["status"], answer["applied_version"]) == (200, "duplicate", None)
    assert answer["round"] == 0
    assert [s.coordinator.version for s in shards] == [0, 0]

    arrive(shards, "w2", 0, G["w2"])  # closes the window: w1 once, w2 once
    at_version(shards, 1)
    # g = (g1 + g2) / 2: a [4, 2, 0, 2], b [2, 0], c [-2]; theta -= 1.5 g (as a mean of two,
    # not of three: the second confirmation added nothing)
    assert_model(whole_model(shards, 1), MEAN_OF_W1_W2_STEP)

    status, answer = confirm(shard0, "w1", 0)  # once more, after its step
    assert (status, answer["status"], answer["applied_version"]) == (200, "duplicate", 0)
    for shard, owned in zip(shards, OWNED, strict=True):  # the applied arrival sent again
        answer = send_slice(shard.url, "w1", 0, {n: G["w3"][n] for n in owned})
        assert (answer["status"], answer["applied_version"]) == ("duplicate", 0), shard.url
    status, answer = confirm(shard0, "w1", 0)
    assert (status, answer["status"], answer["applied_version"]) == (200, "duplicate", 0)

    # shard 1 never got w1's arrival for version 1: not_submitted (not a wait)
    detail = refusal(*result(shard1.url, 1, "w1", wait=5)[:2], 409, "not_submitted")
    assert (detail["round"], detail["worker_id"]) == (1, "w1")
    detail = refusal(*result(shard1.url, 7, "w1", wait=0)[:2], 409, "future_round")
    assert detail["current_round"] == 1

    time.sleep(0.3)
    assert [s.coordinator.version for s in shards] == [1, 1]
    assert_model(whole_model(shards, 1), MEAN_OF_W1_W2_STEP)
    assert decision(shard0, 1) == {"status": "waiting", "round": 1}
    for shard in shards:
        assert submissions(shard) == [("w1", 0, 0, 0), ("w2", 0, 0, 0)]


def test_async_shards_take_int8_both_ways_as_one_server_would(start) -> None:
    """Issue 28, item 1: each shard holds its tensors' parts of an int8 arrival (the codec in
    every slice's header; a plain slice is 422 codec_mismatch and changes nothing), applies
    the decided step, and codes its tensors' int8 delta from the worker's anchor; joined,
    the deltas move the anchor to the step's weights exactly. Each tensor's largest |value|
    is 127, so every upload value decodes exactly; Nesterov (N = 1), lr 1, beta 0.5, first
    step: theta -= 1.5 g: a [1 - 190.5, 2, 3 + 1.5, 4 - 3], b [10 - 190.5, -10 - 3],
    c [0.5 - 190.5]. The delta -1.5 g has largest |value| 190.5 per tensor: scale 1.5, and
    its values are 1.5 times integers, so it codes exactly too."""
    from diloco.algorithm.compression.codecs import Codec
    from diloco.wire.compressed.body import apply_delta, encode_compressed, join_bodies, split_body

    shards = start(upload_codec="int8", download_codec="int8", codec_block=8)
    shard0, shard1 = shards
    register([shard0.url, shard1.url], "w1")
    codec = Codec("int8", block=8)
    sent = {"a": [127.0, 0.0, -1.0, 2.0], "b": [127.0, 2.0], "c": [127.0]}
    parts = split_body(encode_compressed({n: torch.tensor(v) for n, v in sent.items()}, codec),
                       OWNED)  # fmt: skip
    plain = save({n: torch.tensor(sent[n]) for n in OWNED[1]})
    status, data = call(shard1.url, "POST", "/v1/rounds/0/submissions", plain, worker_id="w1")
    assert refusal(status, data, 422, "codec_mismatch") is not None
    for shard, part in zip(shards, parts, strict=True):
        status, data = call(shard.url, "POST", "/v1/rounds/0/submissions", bytes(part),
                            worker_id="w1")  # fmt: skip
        assert status == 200, data
    status, answer = confirm(shard0, "w1", 0)
    assert status == 200 and answer["applied_version"] == 0, answer
    at_version(shards, 1)
    expected = {
        "a": torch.tensor([-189.5, 2.0, 4.5, 1.0]),
        "b": torch.tensor([-180.5, -13.0]),
        "c": torch.tensor([-190.0]),
    }
    assert_model(whole_model(shards, 1), expected)
    deltas = []
    for shard in shards:
        response = HTTP.request(
            "GET", f"{shard.url}/v1/rounds/0/result?worker_id=w1&wait=5&have=0&version=1"
        )
        assert response.status == 200, response.data
        assert response.headers["X-Diloco-Delta-From"] == "0"
        deltas.append(response.data)
    anchor = {name: tensor.clone() for name, tensor in INITIAL.items()}
    apply_delta(join_bodies(deltas), anchor, codec)
    for name, tensor in anchor.items():
        assert torch.equal(tensor, expected[name]), name
    assert submissions(shard0) == submissions(shard1) == [("w1", 0, 0, 0)]


def test_async_shards_clip_and_refuse_by_each_arrivals_whole_norm(start) -> None:
    """clipped_mean (clip 2x, outlier 10x the median of the remembered norms and the
    window's): shard 0 screens each arrival by its whole pseudo-gradient's norm, summed from
    both shards' squares, as one server screens it; every shard folds by its verdict.

    g1 = G["w1"]: squares a 24, b 80, c 4 -> n1 = sqrt(108). w1 arrives twice (versions 1,
    2; history [n1, n1]). w2 then sends a [2, 0, 0, 0], b [24, 0], c [0]: squares 580,
    n = sqrt(580) > 2 n1, clipped to s = 2 sqrt(108) / sqrt(580) = sqrt(108 / 145). (Shard
    0 alone would see a-norms sqrt(24), sqrt(24), 2 and clip nothing; shard 1 alone would clip
    by sqrt(84) / 24.) w3 then sends a [2, 0, 0, 0], b [200, 0]: n = sqrt(40004), over 10x
    the median of [n1, n1, sqrt(580), itself] = (n1 + sqrt(580)) / 2 ~ 17.2: refused (shard 0
    alone sees 2 and keeps it): version 4 is made of nothing and changes nothing, as one
    server's step of a refused arrival. Nesterov (N = 1), lr 1, beta 0.5: m_k = 0.5 m_k-1 +
    g_k, theta_k = theta_k-1 - (0.5 m_k + g_k)."""
    shards = start(aggregation="clipped_mean")
    shard0, _ = shards
    for worker in ("w1", "w2", "w3"):
        register([s.url for s in shards], worker)
    big = {"a": torch.tensor([2.0, 0.0, 0.0, 0.0]), "b": torch.tensor([24.0, 0.0]),
           "c": torch.tensor([0.0])}  # fmt: skip
    huge = {**big, "b": torch.tensor([200.0, 0.0])}
    arrive(shards, "w1", 0, G["w1"])
    at_version(shards, 1)
    arrive(shards, "w1", 1, G["w1"])
    at_version(shards, 2)
    arrive(shards, "w2", 2, big)
    at_version(shards, 3)
    arrive(shards, "w3", 3, huge)
    at_version(shards, 4)
    s = math.sqrt(108 / 145)
    steps_g = [G["w1"], G["w1"], {k: s * big[k] for k in NAMES}]  # (and w3's, nothing)
    model, m = dict(INITIAL), {k: torch.zeros_like(INITIAL[k]) for k in NAMES}
    for g in steps_g:
        m = {k: BETA * m[k] + g[k] for k in NAMES}
        model = {k: model[k] - LR * (BETA * m[k] + g[k]) for k in NAMES}
    assert_model(whole_model(shards, 4), model)
    assert decision(shard0, 2)["scales"] == {"w2": pytest.approx(s, rel=1e-12)}
    assert decision(shard0, 2)["norms"] == {"w2": pytest.approx(math.sqrt(580))}
    assert decision(shard0, 3)["scales"] == {"w3": 0.0}
    assert decision(shard0, 0)["scales"] == {"w1": 1.0}
    for shard in shards:  # every shard's audit log records the clip and the refusal
        events = rows(shard, "SELECT event, worker_id FROM audit WHERE event LIKE 'contribution%'")
        assert events == [("contribution_clipped", "w2"), ("contribution_refused", "w3")]
