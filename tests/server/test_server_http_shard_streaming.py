"""Streaming mode across sharded servers over raw HTTP: two shard coordinators behind real
uvicorn, in threads, each with its own state dir; shard 1 runs the MembershipFollower a
streaming shard starts (server/shards/start.py), asking shard 0 who is live.

The model and its plan, by hand (fragment_plan, 2 fragments): the names show blocks
`blocks.0.` and `blocks.1.`, so the plan strides over them: blocks.0.w (2 numbers) ->
fragment 0, blocks.1.w (4 numbers) -> fragment 1; `head` (1 number) lies outside every block
and goes to the fragment with fewer numbers so far: fragment 0 (2 < 4). Fragment 0 =
[blocks.0.w, head], 3 fp32 = 12 B; fragment 1 = [blocks.1.w], 4 fp32 = 16 B.
Fragments to shards (largest first, to the lightest shard, ties the lower one): fragment 1
(16 B) -> shard 0, then fragment 0 (12 B) -> shard 1, the shard still without one. So shard 0
owns fragment 1 and shard 1 owns fragment 0: the numbers differ on purpose.

Expected weights by hand from the outer update (PyTorch SGD semantics: buf = g on the first
step; nesterov: G -= lr (g + mu buf)); lr 0.5, mu 0.9: a first step is G - 0.95 g.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from test_server_http_shards import (
    ADMIN_SECRET,
    HTTP,
    PROTOCOL,
    SHARD_SECRET,
    TOKEN,
    call,
    json_of,
    serve_in_thread,
)
from urllib3 import HTTPHeaderDict

from diloco.server.coordinator import Coordinator
from diloco.server.ops.launch import free_ports
from diloco.server.settings import ServerSettings
from diloco.server.shards.peers import MembershipFollower, ShardPeers
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore

Tensors = dict[str, torch.Tensor]
INITIAL = {
    "blocks.0.w": torch.tensor([1.0, 2.0]),
    "blocks.1.w": torch.tensor([10.0, 20.0, 30.0, 40.0]),
    "head": torch.tensor([5.0]),
}
SPECS = [
    {"name": n, "shape": list(t.shape), "dtype": "float32", "kind": "trainable"}
    for n, t in INITIAL.items()
]
FRAGMENT = [["blocks.0.w", "head"], ["blocks.1.w"]]  # the whole plan (see the docstring)
OWNER = [1, 0]  # fragment -> shard
OWNED = [["blocks.1.w"], ["blocks.0.w", "head"]]  # shard -> its tensors
PLAN_OF_SHARD = [[[], ["blocks.1.w"]], [["blocks.0.w", "head"], []]]
STREAMING = {
    "mode": "streaming",
    "sync_every": 4,
    "fragments": 2,
    "delay": 1,
    "alpha": 0.5,
    "outer_optimizer": "nesterov",
    "outer_lr": 0.5,
    "outer_momentum": 0.9,
}
G = {  # pseudo-gradients of w1 and w2
    "w1": {"blocks.0.w": torch.tensor([2.0, 4.0]), "head": torch.tensor([1.0]),
           "blocks.1.w": torch.tensor([1.0, 0.0, -1.0, 2.0])},
    "w2": {"blocks.0.w": torch.tensor([0.0, -4.0]), "head": torch.tensor([-3.0]),
           "blocks.1.w": torch.tensor([3.0, 2.0, 1.0, 0.0])},
}  # fmt: skip


@dataclass
class Shard:
    url: str
    coordinator: Coordinator
    follower: MembershipFollower | None = None


@contextlib.contextmanager
def streaming_shards(
    root: Path, token: str | None = None, follow: bool = True, **overrides
) -> Iterator[list[Shard]]:
    """Two streaming shards, each with a state dir under `root`, no --init (the first
    registration fixes the plan, a worker uploads each shard its part); shard 1 follows
    shard 0's membership when `follow`."""
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shards, servers, threads, peers_of = [], [], [], []
    try:
        for index, port in enumerate(ports):
            settings = ServerSettings(
                **{**STREAMING, **overrides}, shard=index, shard_urls=tuple(urls)
            )
            journal = RoundJournal(StateStore(root / f"shard-{index}"), settings)
            peers = ShardPeers(urls, index, SHARD_SECRET if token else None)
            peers_of.append(peers)
            coordinator = Coordinator(settings, None, journal=journal, peers=peers)
            server, thread = serve_in_thread(coordinator, port, token)
            servers.append(server)
            threads.append(thread)
            shard = Shard(urls[index], coordinator)
            if index and follow:
                assert coordinator.shard is not None
                shard.follower = MembershipFollower(
                    peers,
                    coordinator.shard.follow_members,
                    settings.heartbeat_interval,
                    coordinator.clock,
                )
                shard.follower.start()
                threads.append(shard.follower)
            shards.append(shard)
        yield shards
    finally:
        for shard in shards:
            if shard.follower is not None:
                shard.follower.stop()
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(timeout=15)
        for peers in peers_of:
            peers.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., list[Shard]]]:
    """`start(heartbeat_interval=0.2, ...)`: two streaming shards; stopped after."""
    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(streaming_shards(tmp_path, **overrides))


# ----------------------------------------------------------------- calls


def join(shards: list[Shard], worker_id: str, secret: str | None = None) -> list[dict]:
    """Register on shard 0 first (as a worker's ShardedClient does), then on shard 1."""
    body = json.dumps({"protocol_version": 1, "worker_id": worker_id, "tensors": SPECS})
    answers = []
    for shard in shards:
        status, data = call(shard.url, "POST", "/v1/workers", body.encode(), secret=secret)
        assert status == 200, data
        answers.append(json.loads(data))
    return answers


def upload_parts(shards: list[Shard], worker_id: str) -> None:
    for shard, owned in zip(shards, OWNED, strict=True):
        part = save({n: INITIAL[n] for n in owned})
        status, data = call(shard.url, "PUT", "/v1/weights/initial", part, worker_id=worker_id)
        assert status == 200, data
        assert json.loads(data) == {"status": "stored", "round": 0}


def ready(start: Callable[..., list[Shard]], **overrides) -> list[Shard]:
    """Two shards, w1 and w2 registered on both, the initial weights uploaded by w1."""
    shards = start(**overrides)
    join(shards, "w1")
    join(shards, "w2")
    upload_parts(shards, "w1")
    return shards


def submit(url: str, worker_id: str, fragment: int, round_number: int = 0) -> tuple[int, dict]:
    """The worker's pseudo-gradient of `fragment` (its tensors of G) to `url`."""
    body = save({n: G[worker_id][n] for n in FRAGMENT[fragment]})
    path = f"/v1/rounds/{round_number}/submissions"
    status, data = call(url, "POST", path, body, worker_id=worker_id, fragment=fragment)
    return status, json.loads(data)


def weights(url: str) -> tuple[Tensors, HTTPHeaderDict]:
    response = HTTP.request("GET", f"{url}/v1/weights", headers=PROTOCOL)
    assert response.status == 200, response.data
    return load(response.data), response.headers  # case-insensitive names


def result(url: str, worker_id: str, fragment: int, round_number: int = 0, wait: float = 0):
    query = f"worker_id={worker_id}&fragment={fragment}&wait={wait}"
    path = f"{url}/v1/rounds/{round_number}/result?{query}"
    return HTTP.request("GET", path, headers=PROTOCOL)


def refusal(status: int, body: bytes | dict, expected_status: int, kind: str) -> dict:
    """The error body's detail, once status and kind are as expected."""
    assert status == expected_status, body
    if isinstance(body, bytes):
        body = json.loads(body)
    assert body["kind"] == kind, body
    assert isinstance(body["error"], str) and body["error"], body
    return body["detail"]


def assert_tensors(got: Tensors, expected: Tensors) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def initial(names: list[str]) -> Tensors:
    return {n: INITIAL[n] for n in names}


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ----------------------------------------------------------------- tests


def test_each_shard_states_its_fragments_and_its_part_of_the_plan(start) -> None:
    shards = start()
    urls = [shard.url for shard in shards]
    join(shards, "w1")
    for index, shard in enumerate(shards):  # the plan is fixed by the first registration
        info = json_of(call(shard.url, "GET", "/v1/info"))
        assert info["mode"] == "streaming"
        assert info["shards"]["index"] == index
        assert info["shards"]["urls"] == urls
        assert info["shards"]["fragments"] == [f for f in (0, 1) if OWNER[f] == index]
        assert info["shards"]["owned"] == OWNED[index]
        assert info["fragment_plan"] is None  # no weights yet
    upload_parts(shards, "w1")
    for index, shard in enumerate(shards):
        info = json_of(call(shard.url, "GET", "/v1/info"))
        assert info["shards"]["fragments"] == [[1], [0]][index]
        assert info["shards"]["owned"] == OWNED[index]
        assert info["fragment_plan"] == PLAN_OF_SHARD[index]
        assert info["fragment_rounds"] == [0, 0]
        assert info["round"] == 0
        got, headers = weights(shard.url)
        assert_tensors(got, initial(OWNED[index]))
        assert headers["X-Diloco-Round"] == "0"
        assert headers["X-Diloco-Fragment-Rounds"] == "0,0"


def test_a_fragment_round_commits_on_its_own_shard_alone(start) -> None:
    shards = ready(start)
    shard0, shard1 = shards
    # fragment 1 lives on shard 0
    status, answer = submit(shard0.url, "w1", 1)
    assert status == 200, answer
    assert answer["status"] == "accepted"
    assert (answer["round"], answer["fragment"], answer["current_round"]) == (0, 1, 0)
    assert answer["waiting_for"] == ["w2"]
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == ["w2"]
    waiting = result(shard0.url, "w1", 1)
    assert waiting.status == 202, waiting.data
    assert json.loads(waiting.data)["waiting_for"] == ["w2"]
    status, answer = submit(shard0.url, "w2", 1)
    assert status == 200, answer
    assert (answer["status"], answer["current_round"], answer["waiting_for"]) == (
        "accepted",
        1,
        [],
    )
    # mean g of blocks.1.w: ([1, 0, -1, 2] + [3, 2, 1, 0]) / 2 = [2, 1, 0, 1]; G - 0.95 g
    fragment1 = {"blocks.1.w": torch.tensor([10.0 - 1.9, 20.0 - 0.95, 30.0, 40.0 - 0.95])}
    assert shard0.coordinator.version == 1
    response = result(shard0.url, "w1", 1, wait=5)
    assert response.status == 200, response.data
    assert response.headers["X-Diloco-Round"] == "1"  # the fragment's next round
    assert response.headers["X-Diloco-Fragment"] == "1"
    assert_tensors(load(response.data), fragment1)
    got, headers = weights(shard0.url)
    assert_tensors(got, fragment1)
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("1", "0,1")
    info = json_of(call(shard0.url, "GET", "/v1/info"))
    assert (info["round"], info["fragment_rounds"]) == (1, [0, 1])

    # fragment 0 on shard 1: untouched until its own round commits there
    assert shard1.coordinator.version == 0
    got, headers = weights(shard1.url)
    assert_tensors(got, initial(OWNED[1]))
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("0", "0,0")
    status, answer = submit(shard1.url, "w2", 0)
    assert status == 200, answer
    assert (answer["status"], answer["fragment"], answer["waiting_for"]) == ("accepted", 0, ["w1"])
    status, answer = submit(shard1.url, "w1", 0)
    assert status == 200, answer
    assert (answer["status"], answer["current_round"]) == ("accepted", 1)
    # mean g: blocks.0.w ([2, 4] + [0, -4]) / 2 = [1, 0], head (1 - 3) / 2 = -1; G - 0.95 g
    fragment0 = {"blocks.0.w": torch.tensor([1.0 - 0.95, 2.0]), "head": torch.tensor([5.95])}
    response = result(shard1.url, "w2", 0, wait=5)
    assert response.status == 200, response.data
    assert (response.headers["X-Diloco-Round"], response.headers["X-Diloco-Fragment"]) == (
        "1",
        "0",
    )
    assert_tensors(load(response.data), fragment0)
    got, headers = weights(shard1.url)
    assert_tensors(got, fragment0)
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("1", "1,0")
    # shard 0 did not move with shard 1's round
    got, headers = weights(shard0.url)
    assert_tensors(got, fragment1)
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("1", "0,1")
    assert [s.coordinator.version for s in shards] == [1, 1]


def test_a_second_fragment_round_steps_with_its_momentum(start) -> None:
    """Two rounds of fragment 0 on shard 1 from w1 alone (w2 left): buf = g, then
    buf = mu buf + g; G -= lr (g + mu buf)."""
    shards = ready(start)
    shard0, shard1 = shards
    for shard in shards:  # w2 leaves every shard, as a worker's ShardedClient does
        assert call(shard.url, "DELETE", "/v1/workers/w2")[0] == 200
    assert submit(shard1.url, "w1", 0, 0)[0] == 200
    assert submit(shard1.url, "w1", 0, 1)[0] == 200
    # step 1: g = [2, 4], [1]: G1 = G0 - 0.95 g = [1 - 1.9, 2 - 3.8], [5 - 0.95]
    # step 2: buf = 0.9 g + g = 1.9 g; G2 = G1 - 0.5 (g + 0.9 * 1.9 g) = G1 - 1.355 g
    #   blocks.0.w: [-0.9 - 2.71, -1.8 - 5.42] = [-3.61, -7.22]; head 4.05 - 1.355 = 2.695
    got, headers = weights(shard1.url)
    assert_tensors(got, {"blocks.0.w": torch.tensor([-3.61, -7.22]), "head": torch.tensor([2.695])})
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("2", "2,0")
    got, headers = weights(shard0.url)
    assert_tensors(got, initial(OWNED[0]))
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("0", "0,0")


def test_a_fragment_sent_to_the_shard_that_does_not_own_it_is_refused(start) -> None:
    """Fragment 0 (blocks.0.w, head) to shard 0 and fragment 1 (blocks.1.w) to shard 1, each
    with its own tensors as a worker sends them: docs/protocol.md says 409 wrong_shard,
    naming the fragment; the result poll of a foreign fragment too. Nothing moves."""
    shards = ready(start)
    shard0, shard1 = shards
    misrouted = [(shard0.url, 0), (shard1.url, 1)]
    for url, fragment in misrouted:
        response = result(url, "w1", fragment)
        detail = refusal(response.status, response.data, 409, "wrong_shard")
        assert detail == {"fragment": fragment}, url
    answers = [submit(url, "w1", fragment) for url, fragment in misrouted]
    for shard, owned in zip(shards, OWNED, strict=True):
        got, headers = weights(shard.url)
        assert_tensors(got, initial(owned))
        assert headers["X-Diloco-Fragment-Rounds"] == "0,0"
        status = json_of(call(shard.url, "GET", "/v1/status"))
        # the shard's own fragment's round 0 still waits for both members: nothing counted
        assert (status["round"], status["fragment_rounds"], status["waiting_for"]) == (
            0,
            [0, 0],
            ["w1", "w2"],
        )
    assert [s.coordinator.version for s in shards] == [0, 0]
    for (url, fragment), (status, answer) in zip(misrouted, answers, strict=True):
        detail = refusal(status, answer, 409, "wrong_shard")
        assert detail == {"fragment": fragment}, url


def test_the_cross_shard_commit_routes_do_not_apply_and_change_nothing(start) -> None:
    shards = ready(start)
    shard0, shard1 = shards
    assert submit(shard0.url, "w1", 1)[0] == 200  # w1 is in fragment 1's round
    for shard in shards:
        status, data = call(shard.url, "POST", "/v1/rounds/0/confirm", worker_id="w1")
        assert refusal(status, data, 409, "not_applicable") == {}, shard.url
        status, data = call(shard.url, "GET", "/v1/shard/prepared", round=0, worker_id="w1")
        assert refusal(status, data, 409, "not_applicable") == {}, shard.url
        status, data = call(shard.url, "GET", "/v1/shard/decisions/0")
        assert refusal(status, data, 409, "not_applicable") == {}, shard.url
    status, data = call(shard1.url, "GET", "/v1/shard/live")
    assert refusal(status, data, 409, "not_shard_0") == {}
    live = json_of(call(shard0.url, "GET", "/v1/shard/live"))
    stamp = shard0.coordinator.control.pause_stamp
    assert live == {"live": ["w1", "w2"], "paused": False, "pause_stamp": stamp}
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == ["w2"]
    assert [s.coordinator.version for s in shards] == [0, 0]
    for shard, owned in zip(shards, OWNED, strict=True):
        got, _ = weights(shard.url)
        assert_tensors(got, initial(owned))


def test_datasets_are_not_built_on_streaming_shards(start) -> None:
    shards = ready(start)
    ask = {"worker_id": "w1", "dataset_id": "corpus", "length": 100, "unit_size": 10}
    for shard in shards:
        response = HTTP.request(
            "POST",
            f"{shard.url}/v1/datasets",
            body=json.dumps(ask).encode(),
            headers={**PROTOCOL, "Content-Type": "application/json"},
        )
        assert refusal(response.status, response.data, 409, "not_built") == {}, shard.url
        assert json_of(call(shard.url, "GET", "/v1/datasets")) == {"datasets": []}
        assert json_of(call(shard.url, "GET", "/v1/status"))["datasets"] == []
        assert shard.coordinator.version == 0


def test_a_workers_own_credential_may_not_ask_who_is_live(start) -> None:
    shards = start(token=TOKEN)
    shard0, _ = shards
    (answer, on_shard_1) = join(shards, "w1", secret=TOKEN)
    credential = answer["credential"]
    for secret, scope in ((credential, "worker:w1"), (TOKEN, "enroll")):
        status, data = call(shard0.url, "GET", "/v1/shard/live", secret=secret)
        detail = refusal(status, data, 403, "forbidden")
        assert detail == {"scope": scope, "required": "shard"}
    status, data = call(shard0.url, "GET", "/v1/shard/live")
    assert status == 401, data
    assert json.loads(data)["kind"] == "unauthorized"
    status, data = call(shard0.url, "GET", "/v1/shard/live", secret=SHARD_SECRET)
    assert status == 200, data
    stamp = shard0.coordinator.control.pause_stamp
    assert json.loads(data) == {"live": ["w1"], "paused": False, "pause_stamp": stamp}
    # pausing a follower is shard 0's alone: not even an admin (who pauses shard 0)
    _, shard1 = shards
    for secret, scope in ((ADMIN_SECRET, "admin"), (on_shard_1["credential"], "worker:w1")):
        status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": true}',
                            secret=secret)  # fmt: skip
        assert refusal(status, data, 403, "forbidden") == {"scope": scope, "required": "shard"}
    assert not shard1.coordinator.control.paused
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": true}',
                        secret=SHARD_SECRET)  # fmt: skip
    assert status == 200 and shard1.coordinator.control.paused, data


def test_a_worker_evicted_on_shard_0_is_evicted_on_shard_1_and_its_round_goes_on(start) -> None:
    shards = ready(start, heartbeat_interval=0.2)
    shard0, shard1 = shards
    # w1's submissions open each fragment's round; both wait for w2
    assert submit(shard1.url, "w1", 0)[0] == 200
    assert submit(shard0.url, "w1", 1)[0] == 200
    time.sleep(0.5)  # the follower asked shard 0 at least twice: w2 is live there
    assert shard1.coordinator.membership.is_live("w2")
    assert [s.coordinator.version for s in shards] == [0, 0]

    status, data = call(shard0.url, "POST", "/v1/admin/workers/w2/evict", b"{}")
    assert status == 200, data

    def w2_gone_on_shard_1() -> bool:
        workers = json_of(call(shard1.url, "GET", "/v1/status"))["workers"]
        return all(not w["live"] for w in workers if w["worker_id"] == "w2")

    wait_until(w2_gone_on_shard_1, "shard 1 never followed shard 0's eviction of w2")
    wait_until(lambda: shard1.coordinator.version == 1, "fragment 0's round never committed")
    wait_until(lambda: shard0.coordinator.version == 1, "fragment 1's round never committed")
    # w1 alone: fragment 0 G - 0.95 g_w1: blocks.0.w [1 - 1.9, 2 - 3.8], head [5 - 0.95]
    got, headers = weights(shard1.url)
    assert_tensors(got, {"blocks.0.w": torch.tensor([-0.9, -1.8]), "head": torch.tensor([4.05])})
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("1", "1,0")
    # fragment 1 on shard 0: [10 - 0.95, 20, 30 + 0.95, 40 - 1.9]
    got, headers = weights(shard0.url)
    assert_tensors(got, {"blocks.1.w": torch.tensor([9.05, 20.0, 30.95, 38.1])})
    assert (headers["X-Diloco-Round"], headers["X-Diloco-Fragment-Rounds"]) == ("1", "0,1")
    for shard, rounds in ((shard0, [0, 1]), (shard1, [1, 0])):
        status = json_of(call(shard.url, "GET", "/v1/status"))
        # the fragment's next round is open and waits for the survivor alone
        assert (status["waiting_for"], status["fragment_rounds"]) == (["w1"], rounds)
    assert shard1.coordinator.membership.is_live("w1")  # the survivor stays
    events = json_of(call(shard1.url, "GET", "/v1/admin/audit"))["events"]
    assert [e["event"] for e in events if e["worker_id"] == "w2"][-1] == "evicted_on_shard_0"
    # w2 asks shard 1 for fragment 0's result: it is no longer a member there
    response = result(shard1.url, "w2", 0)
    refusal(response.status, response.data, 404, "unknown_worker")


def test_a_worker_heard_from_after_shard_0_answered_waits_for_the_next_question(
    start,
) -> None:
    """follow_members(live, asked_at): w1, registered on shard 1 before the question and
    not in the answer, is evicted; w2, registered on shard 1 after `asked_at` (it may have
    registered on shard 0 after the answer), is kept."""
    shards = start(follow=False)
    _, shard1 = shards
    coordinator = shard1.coordinator
    assert coordinator.shard is not None
    join(shards, "w1")
    time.sleep(0.01)
    asked_at = coordinator.clock()
    time.sleep(0.01)
    # w2 registers on shard 0, then on shard 1 (which asks shard 0 first), after asked_at:
    # shard 0's answer, taken at asked_at, did not know w2
    join(shards, "w2")
    coordinator.shard.follow_members(set(), asked_at)
    assert not coordinator.membership.is_live("w1")
    assert coordinator.membership.is_live("w2")
    # asked again later, shard 0 holds w2 live: nobody more leaves
    coordinator.shard.follow_members({"w2"}, coordinator.clock())
    assert coordinator.membership.is_live("w2")
    # and with an answer that no longer holds w2, asked after w2 was last heard from: it goes
    coordinator.shard.follow_members(set(), coordinator.clock())
    assert not coordinator.membership.is_live("w2")
    workers = {
        w["worker_id"]: w["live"] for w in json_of(call(shard1.url, "GET", "/v1/status"))["workers"]
    }
    assert workers == {"w1": False, "w2": False}


def test_a_pause_on_shard_0_holds_every_shards_fragment_rounds_until_resumed(start) -> None:
    """Shard 0 tells shard 1 at once (its answer names no shard it could not tell); while
    paused, both workers' slices of fragment 0 fold on shard 1 and nothing commits; the
    resume commits the round there (the plain mean: G - 0.95 g, worked out above)."""
    shards = ready(start)
    shard0, shard1 = shards
    status, data = call(shard0.url, "POST", "/v1/admin/pause", b"")
    answer = json.loads(data)
    assert status == 200 and answer["paused"] is True and answer["shards_not_told"] == [], data
    assert json_of(call(shard1.url, "GET", "/v1/status"))["paused"] is True
    assert json_of(call(shard0.url, "GET", "/v1/shard/live"))["paused"] is True
    assert submit(shard1.url, "w1", 0)[0] == 200
    status, answer = submit(shard1.url, "w2", 0)
    assert status == 200 and answer["waiting_for"] == [], answer
    time.sleep(0.3)
    assert shard1.coordinator.version == 0  # held: the pause
    events = json_of(call(shard1.url, "GET", "/v1/admin/audit"))["events"]
    assert [e["detail"].get("by") for e in events if e["event"] == "paused"] == ["shard 0"]
    status, data = call(shard0.url, "POST", "/v1/admin/resume", b"")
    assert status == 200 and json.loads(data)["shards_not_told"] == [], data
    wait_until(lambda: shard1.coordinator.version == 1, "the resume never committed fragment 0")
    fragment0 = {"blocks.0.w": torch.tensor([1.0 - 0.95, 2.0]), "head": torch.tensor([5.95])}
    assert_tensors(weights(shard1.url)[0], fragment0)
    assert json_of(call(shard1.url, "GET", "/v1/status"))["paused"] is False
    # shard 1 itself stays steered from shard 0; shard 0's word is the shards' own route
    status, data = call(shard1.url, "POST", "/v1/admin/pause", b"")
    assert refusal(status, data, 409, "not_shard_0") == {}
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": "yes"}')
    assert status == 422 and json.loads(data)["detail"]["field"] == "paused", data
    status, data = call(shard0.url, "POST", "/v1/shard/paused", b'{"paused": true}')
    assert refusal(status, data, 409, "not_applicable") == {}
    assert json_of(call(shard0.url, "GET", "/v1/status"))["paused"] is False


def test_a_shard_that_missed_shard_0s_word_follows_when_it_next_asks(start) -> None:
    """follow_members(live, asked_at, paused, stamp): shard 0's state from the question of who
    is live; a word stamped no later than one already taken, pushed or answered, changes
    nothing (a pause and a resume pushed close together may arrive in either order)."""
    shards = start(follow=False)
    _, shard1 = shards
    coordinator = shard1.coordinator
    assert coordinator.shard is not None
    join(shards, "w1")
    coordinator.shard.follow_members({"w1"}, coordinator.clock(), paused=True, stamp=10)
    assert coordinator.control.paused
    # shard 0 resumed (stamp 12), then paused again (14): the pause's push arrives first
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": true, "stamp": 14}')
    assert status == 200 and json.loads(data) == {"paused": True, "changed": False}, data
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": false, "stamp": 12}')
    assert status == 200 and json.loads(data) == {"paused": True, "changed": False}, data
    assert coordinator.control.paused  # the older resume is not taken
    coordinator.shard.follow_members({"w1"}, coordinator.clock(), paused=False, stamp=13)
    assert coordinator.control.paused  # nor an answer older than the newest word
    # shard 0 resumed (16): the answer that says so comes before the push
    coordinator.shard.follow_members({"w1"}, coordinator.clock(), paused=False, stamp=16)
    assert not coordinator.control.paused
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": false, "stamp": 16}')
    assert status == 200 and json.loads(data) == {"paused": False, "changed": False}, data
    # a word without a stamp (a shard 0 that does not send one) is taken as it comes
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": true}')
    assert status == 200 and json.loads(data) == {"paused": True, "changed": True}, data
    status, data = call(shard1.url, "POST", "/v1/shard/paused", b'{"paused": true, "stamp": -1}')
    assert status == 422 and json.loads(data)["detail"]["field"] == "stamp", data


def test_shard_0s_stamps_order_its_pauses_and_resumes(start) -> None:
    """Each pause or resume on shard 0 gets a later stamp than the last, and its answer to who
    is live says the stamp of its state."""
    shard0, _ = start(follow=False)
    control = shard0.coordinator.control
    stamps = [json_of(call(shard0.url, "GET", "/v1/shard/live"))["pause_stamp"]]
    for action in ("pause", "resume", "pause"):
        getattr(control, action)("admin", 0)
        live = json_of(call(shard0.url, "GET", "/v1/shard/live"))
        assert live["paused"] == (action == "pause")
        stamps.append(live["pause_stamp"])
    assert stamps == sorted(stamps) and len(set(stamps)) == 4, stamps
    assert control.pause("admin", 0) is False  # already paused: the same word, the same stamp
    assert json_of(call(shard0.url, "GET", "/v1/shard/live"))["pause_stamp"] == stamps[-1]


def test_a_follower_asks_shard_0_at_once_when_it_starts() -> None:
    """A follower restarted while shard 0 is paused learns it from its first question, asked
    as it starts, not a heartbeat interval later (here 60 s)."""

    class Shard0:
        def live_members(self) -> tuple[set[str], bool, int]:
            return {"w1"}, True, 7

    heard: list[tuple[set[str], bool | None, int | None]] = []
    follower = MembershipFollower(
        Shard0(),
        lambda live, asked_at, paused, stamp: heard.append((live, paused, stamp)),
        60.0,  # type: ignore[arg-type]
    )
    follower.start()
    try:
        wait_until(lambda: bool(heard), "the follower did not ask at once", seconds=5)
    finally:
        follower.stop()
        follower.join(timeout=5)
    assert heard == [({"w1"}, True, 7)]


def test_which_codecs_and_aggregations_sharded_servers_take() -> None:
    """Shards take every codec in every mode, and a top-k codec's aggregation in sync and
    streaming mode is sparse_mean, as on one server (each shard averages its own tensors'
    elements over their senders); the robust rules in sync mode (shard 0 screens each
    worker's whole pseudo-gradient from every shard's sums) and streaming mode (each
    fragment's body is whole on its shard); in async mode clipped_mean, as on one server."""
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    streaming = {"mode": "streaming", "fragments": 2, "sync_every": 4}
    for mode in ({}, streaming):
        for codec, aggregation in (("int8", "mean"), ("int2", "mean"),
                                   ("topk:0.03+int2", "sparse_mean")):  # fmt: skip
            settings = ServerSettings(upload_codec=codec, shard_urls=urls, **mode)
            assert (settings.upload_codec, settings.aggregation) == (codec, aggregation)
        settings = ServerSettings(download_codec="int8", shard_urls=urls, **mode)
        assert settings.download_codec == "int8"
    settings = ServerSettings(mode="async", upload_codec="int8", download_codec="int8",
                              shard_urls=urls)  # fmt: skip
    assert (settings.upload_codec, settings.aggregation) == ("int8", "mean")
    for mode in ({}, streaming):
        for rule in ("median", "clipped_mean", "trimmed_mean:0.2"):
            assert ServerSettings(aggregation=rule, shard_urls=urls, **mode).aggregation == rule
    # async: what one server takes there (an element-wise rule needs a round)
    assert ServerSettings(mode="async", aggregation="clipped_mean", shard_urls=urls).aggregation
    with pytest.raises(ValueError, match="mode async applies each arrival alone"):
        ServerSettings(mode="async", aggregation="median", shard_urls=urls)


def test_streaming_shards_need_one_fragment_per_shard() -> None:
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    with pytest.raises(ValueError, match="at least one fragment per shard") as refused:
        ServerSettings(mode="streaming", fragments=1, shard_urls=urls)
    assert "1 fragments for 2 shards" in str(refused.value)
    ServerSettings(mode="streaming", fragments=2, sync_every=4, shard_urls=urls)  # enough


def test_a_follower_takes_shard_0s_plan_and_only_workers_shard_0_admitted(start) -> None:
    """Shard 1 sees w2's tensor list first, in another order than the w1's that fixed shard
    0's plan: it cuts its part from shard 0's plan, not from w2's list (the order of the names
    within a fragment shows which). A worker shard 0 does not hold (never registered there,
    or banned) is refused on shard 1: a streaming follower commits rounds alone."""
    shard0, shard1 = start()
    body = json.dumps({"protocol_version": 1, "worker_id": "w1", "tensors": SPECS})
    assert call(shard0.url, "POST", "/v1/workers", body.encode())[0] == 200
    reversed_specs = list(reversed(SPECS))  # head, blocks.1.w, blocks.0.w
    body = json.dumps({"protocol_version": 1, "worker_id": "w2", "tensors": reversed_specs})
    for shard in (shard0, shard1):
        status, data = call(shard.url, "POST", "/v1/workers", body.encode())
        assert status == 200, data
    upload_parts([shard0, shard1], "w2")
    plan = json_of(call(shard1.url, "GET", "/v1/info"))["fragment_plan"]
    assert plan == PLAN_OF_SHARD[1]  # [["blocks.0.w", "head"], []], shard 0's order
    # never registered on shard 0
    body = json.dumps({"protocol_version": 1, "worker_id": "w3", "tensors": SPECS})
    status, data = call(shard1.url, "POST", "/v1/workers", body.encode())
    assert refusal(status, data, 409, "not_on_shard_0") == {"worker_id": "w3"}
    # banned on shard 0 (after it left shard 1 too)
    status, data = call(shard0.url, "POST", "/v1/admin/workers/w1/evict", b'{"ban": true}')
    assert status == 200, data
    body = json.dumps({"protocol_version": 1, "worker_id": "w1", "tensors": SPECS})
    status, data = call(shard1.url, "POST", "/v1/workers", body.encode())
    assert status == 409, data
    assert json.loads(data)["kind"] == "not_on_shard_0", data
    live = {w["worker_id"] for w in json_of(call(shard1.url, "GET", "/v1/status"))["workers"]}
    assert "w3" not in live


def test_shard_0_states_the_whole_plan_and_a_follower_refers_to_it(start) -> None:
    shard0, shard1 = start()
    assert json_of(call(shard0.url, "GET", "/v1/shard/plan")) == {"plan": None}  # none yet
    join([shard0, shard1], "w1")
    assert json_of(call(shard0.url, "GET", "/v1/shard/plan")) == {"plan": FRAGMENT}
    status, data = call(shard1.url, "GET", "/v1/shard/plan")
    assert refusal(status, data, 409, "not_shard_0") == {}


def test_a_word_whose_pause_failed_is_taken_when_it_comes_again(start) -> None:
    """A follower whose pause failed part way (its state write, say) has not used up the
    word's stamp: the same answer at the next question pauses it."""
    shards = start(follow=False)
    _, shard1 = shards
    commit = shard1.coordinator.shard
    assert commit is not None
    real = commit.follow_pause
    calls: list[bool] = []

    def failing_once(paused: bool) -> bool:
        calls.append(paused)
        if len(calls) == 1:
            raise OSError("the state write failed")
        return real(paused)

    commit.follow_pause = failing_once
    with pytest.raises(OSError):
        commit.follow_members(set(), shard1.coordinator.clock(), paused=True, stamp=100)
    assert not shard1.coordinator.control.paused
    commit.follow_members(set(), shard1.coordinator.clock(), paused=True, stamp=100)
    assert shard1.coordinator.control.paused and calls == [True, True]


def test_shard_0s_stamps_stay_ordered_across_a_restart_whose_clock_went_back(
    tmp_path, monkeypatch
) -> None:
    from diloco.server.ops import control as control_module
    from diloco.server.ops.control import RunControl
    from diloco.server.state.store import StateStore

    state = StateStore(tmp_path / "state")
    try:
        first = RunControl(state, ServerSettings(), lambda: 0.0)
        first.pause("admin", 0)
        stamp = first.pause_stamp
        monkeypatch.setattr(control_module.time, "time_ns", lambda: stamp - 10**12)
        restarted = RunControl(state, ServerSettings(), lambda: 0.0)
        assert restarted.pause_stamp > stamp  # its words still come after the stored one
        restarted.resume("admin", 0)
        assert restarted.pause_stamp == stamp + 2
    finally:
        state.close()


def test_a_streaming_shard_screens_and_combines_its_fragments_as_one_server(start) -> None:
    """Issue 28, item 1: a fragment's body goes whole to its shard, so the robust rules run
    there as on one server. Median of three for fragment 1 (blocks.1.w, on shard 0):
    w1 [1, 0, -1, 2], w2 [3, 2, 1, 0], w3 [8, 1, 0, 4]; norms 2.45, 3.74, 9 (none above 10x
    their median); median [3, 1, 0, 2] (the mean would be [4, 1, 0, 2]); each one's dot
    with it 7, 11, 33 > 0 (none opposed); nesterov lr 0.5, mu 0.9, first step: G - 0.95 g."""
    shards = start(aggregation="median")
    for worker in ("w1", "w2", "w3"):
        join(shards, worker)
    upload_parts(shards, "w1")
    shard0 = shards[0]
    sent = {"w1": [1.0, 0.0, -1.0, 2.0], "w2": [3.0, 2.0, 1.0, 0.0], "w3": [8.0, 1.0, 0.0, 4.0]}
    for worker, values in sent.items():
        body = save({"blocks.1.w": torch.tensor(values)})
        status, data = call(shard0.url, "POST", "/v1/rounds/0/submissions", body,
                            worker_id=worker, fragment=1)  # fmt: skip
        assert status == 200, data
    wait_until(lambda: shard0.coordinator.version == 1, "fragment 1's round never committed")
    got, _ = weights(shard0.url)
    assert_tensors(got, {"blocks.1.w": torch.tensor([10.0 - 2.85, 20.0 - 0.95, 30.0, 40.0 - 1.9])})
    info = json_of(call(shards[1].url, "GET", "/v1/info"))
    assert info["settings"]["aggregation"] == "median"


def test_a_streaming_follower_without_weights_starts_only_if_it_never_stored_any(
    start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard 0 holds the run's weights. A follower whose state dir holds no weights starts
    only when that dir is this run's (shard 0's fragment plan), never recorded its initial
    weights as stored and never committed a round: it was killed writing them, before it
    answered the upload, so the worker that sent them sends them again. A dir of no run,
    one whose weights were stored once, or one that committed a round is refused."""
    from diloco.server.shards.start import ShardStart

    shards = ready(start)
    urls = tuple(shard.url for shard in shards)
    settings = ServerSettings(**STREAMING, shard=1, shard_urls=urls)
    whole_plan = ShardPeers(list(urls), 1, None).whole_plan()
    assert whole_plan is not None

    def restarted(state_dir: Path) -> Coordinator:
        journal = RoundJournal(StateStore(state_dir), settings)
        return Coordinator(settings, None, journal=journal, peers=ShardPeers(list(urls), 1, None))

    def follow(coordinator: Coordinator) -> None:
        started = ShardStart(settings, None, None, "round", tmp_path).follow(coordinator)
        assert started is not None
        started.stop()
        started.join(timeout=10)

    with pytest.raises(ValueError, match="lost or is another run's"):
        follow(restarted(tmp_path / "no-run"))
    killed = restarted(tmp_path / "killed")
    killed.journal.state.set_meta("whole_fragment_plan", whole_plan)
    with caplog.at_level("WARNING", logger="diloco.server"):
        follow(killed)  # starts: it takes its part again, and says so
    assert "stopped before its initial weights were stored" in caplog.text
    assert killed.masters is None
    # its initial weights were stored once (the record written before the upload's answer)
    stored = restarted(tmp_path / "stored")
    stored.journal.state.set_meta("whole_fragment_plan", whole_plan)
    stored.journal.state.set_meta("settings", settings.to_wire())
    with pytest.raises(ValueError, match="lost or is another run's"):
        follow(stored)
    killed.journal.state.record_commit(0, ["w1"], [], 1, 0.1, fragment=0, fragment_round=0)
    with pytest.raises(ValueError, match="lost or is another run's"):
        follow(killed)
