"""Sharded servers over raw HTTP: two shard coordinators behind real uvicorn, in threads.

Expected weights are worked out by hand from the outer update (PyTorch SGD semantics:
buf = g on the first step; nesterov: G -= lr (g + mu buf)). The layout by hand: tensors in
name order, largest first to the lighter shard: a (16 B) -> shard 0, b (8 B) -> shard 1,
c (4 B) -> shard 1.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import urllib3
from safetensors.torch import load, save

from diloco.server.coordinator import Coordinator
from diloco.server.http.runner import build_server
from diloco.server.members.credentials import Credentials
from diloco.server.ops.launch import free_ports
from diloco.server.settings import ServerSettings
from diloco.server.shards.peers import DecisionFollower, ShardPeers

INITIAL = {
    "a": torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "b": torch.tensor([10.0, -10.0]),
    "c": torch.tensor([0.5]),
}
OWNED = [["a"], ["b", "c"]]
SPECS = [
    {"name": n, "shape": list(t.shape), "dtype": "float32", "kind": "trainable"}
    for n, t in INITIAL.items()
]
HTTP = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
PROTOCOL = {"X-Diloco-Protocol": "1"}


def call(
    url: str, method: str, path: str, body: bytes | None = None, secret: str | None = None,
    **fields,
) -> tuple:  # fmt: skip
    query = "&".join(f"{k}={v}" for k, v in fields.items())
    content = {"Content-Type": "application/octet-stream"} if body is not None else {}
    if method == "POST" and (path == "/v1/workers" or path.startswith("/v1/admin")):
        content = {"Content-Type": "application/json"}
    auth = {"Authorization": f"Bearer {secret}"} if secret else {}
    response = HTTP.request(
        method, f"{url}{path}?{query}", body=body, headers={**PROTOCOL, **content, **auth}
    )
    return response.status, response.data


def json_of(answer: tuple) -> dict:
    return json.loads(answer[1])


@pytest.fixture
def two_shards() -> Iterator[list[tuple[str, Coordinator]]]:
    yield from started_shards(None)


@pytest.fixture
def two_shards_with_token() -> Iterator[list[tuple[str, Coordinator]]]:
    yield from started_shards(TOKEN)


@pytest.fixture
def two_int8_shards() -> Iterator[list[tuple[str, Coordinator]]]:
    yield from started_shards(None, upload_codec="int8", download_codec="int8", codec_block=8)


TOKEN = "enroll-secret-0123456789"
SHARD_SECRET = "shard-secret-0123456789"  # the tokens file's line "SHARD_SECRET shard"
ADMIN_SECRET = "admin-secret-0123456789"


def serve_in_thread(coordinator: Coordinator, port: int, token: str | None):
    """uvicorn over `coordinator` on 127.0.0.1:`port` in a daemon thread, once it listens;
    with `token`, also the tokens file's shard and admin secrets."""
    tokens = {SHARD_SECRET: "shard", ADMIN_SECRET: "admin"}
    credentials = Credentials([token], tokens) if token else None
    server = build_server(coordinator, "127.0.0.1", port, credentials, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while server.bound_port is None:
        assert thread.is_alive(), "a shard did not start"
        time.sleep(0.01)
    return server, thread


def started_shards(
    token: str | None, follow: bool = True, **overrides
) -> Iterator[list[tuple[str, Coordinator]]]:
    """Two shards; `follow`: shard 1 runs its decision loop (else a test speaks for it)."""
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    started, threads, followers = [], [], []
    for shard, port in enumerate(ports):
        settings = ServerSettings(
            outer_optimizer="nesterov",
            outer_lr=0.5,
            outer_momentum=0.9,
            min_workers=1,
            shard=shard,
            shard_urls=tuple(urls),
            **overrides,
        )
        initial = {name: INITIAL[name].clone() for name in OWNED[shard]}
        peers = ShardPeers(urls, shard, SHARD_SECRET if token else None)
        coordinator = Coordinator(settings, initial, peers=peers)
        server, thread = serve_in_thread(coordinator, port, token)
        if shard and follow:
            follower = DecisionFollower(peers, coordinator.shard, wait=2)
            follower.start()
            followers.append(follower)
        started.append((urls[shard], coordinator, server))
        threads.append(thread)
    yield [(url, coordinator) for url, coordinator, _ in started]
    for follower in followers:
        follower.stop()
    for _, _, server in started:
        server.should_exit = True
    for thread in threads:
        thread.join(timeout=15)


def register(urls: list[str], worker_id: str) -> None:
    body = json.dumps({"protocol_version": 1, "worker_id": worker_id, "tensors": SPECS}).encode()
    for url in urls:
        status, data = call(url, "POST", "/v1/workers", body)
        assert status == 200, data


def submit(url: str, worker_id: str, tensors: dict[str, torch.Tensor]) -> tuple:
    return call(url, "POST", "/v1/rounds/0/submissions", save(tensors), worker_id=worker_id)


def weights(url: str) -> tuple[dict[str, torch.Tensor], int]:
    response = HTTP.request("GET", f"{url}/v1/weights")
    assert response.status == 200, response.data
    return load(response.data), int(response.headers["X-Diloco-Round"])


G = {  # pseudo-gradients of w1 and w2
    "w1": {"a": torch.tensor([1.0, 0.0, -1.0, 2.0]), "b": torch.tensor([2.0, 4.0]),
           "c": torch.tensor([1.0])},
    "w2": {"a": torch.tensor([3.0, 2.0, 1.0, 0.0]), "b": torch.tensor([0.0, -4.0]),
           "c": torch.tensor([-3.0])},
}  # fmt: skip


def test_info_on_any_shard_names_every_shard_and_what_each_owns(two_shards) -> None:
    urls = [url for url, _ in two_shards]
    for shard, url in enumerate(urls):
        info = json_of(call(url, "GET", "/v1/info"))
        assert info["shards"]["urls"] == urls
        assert info["shards"]["index"] == shard
        assert info["shards"]["owned"] == OWNED[shard]


def test_a_round_commits_on_every_shard_only_once_all_hold_every_slice(two_shards) -> None:
    (url0, leader), (url1, follower) = two_shards
    register([url0, url1], "w1")
    register([url0, url1], "w2")
    for worker in ("w1", "w2"):
        status, data = submit(url0, worker, {"a": G[worker]["a"]})
        assert status == 200, data
    status, data = submit(url1, "w1", {n: G["w1"][n] for n in ("b", "c")})
    assert status == 200, data
    assert json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1"))["status"] == (
        "accepted"
    )
    # w2 reached shard 0 only: its confirmation names shard 1, and nothing commits anywhere
    status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2")
    assert status == 409, data
    refusal = json.loads(data)
    assert refusal["kind"] == "not_prepared" and refusal["detail"]["shards"] == [1]
    time.sleep(0.5)
    assert leader.version == 0 and follower.version == 0
    assert json_of(call(url0, "GET", "/v1/status"))["waiting_for"] == ["w2"]

    status, data = submit(url1, "w2", {n: G["w2"][n] for n in ("b", "c")})
    assert status == 200, data
    assert json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2"))["status"] == (
        "accepted"
    )
    # mean g: a [2, 1, 0, 1], b [1, 0], c [-1]; nesterov lr 0.5, mu 0.9, first step buf = g:
    # G -= 0.5 * (g + 0.9 g) = G - 0.95 g
    expected = {
        "a": torch.tensor([1.0 - 1.9, 2.0 - 0.95, 3.0, 4.0 - 0.95]),
        "b": torch.tensor([10.0 - 0.95, -10.0]),
        "c": torch.tensor([0.5 + 0.95]),
    }
    deadline = time.monotonic() + 20
    while follower.version < 1:
        assert time.monotonic() < deadline, "shard 1 never applied shard 0's decision"
        time.sleep(0.05)
    got0, round0 = weights(url0)
    got1, round1 = weights(url1)
    assert (round0, round1) == (1, 1)
    assert set(got0) == {"a"} and set(got1) == {"b", "c"}
    for name, tensor in {**got0, **got1}.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    decision = json_of(call(url0, "GET", "/v1/shard/decisions/0"))
    assert decision.pop("sessions").keys() == {"w1", "w2"}  # digests of their sessions
    assert decision == {
        "status": "decided",
        "round": 0,
        "contributors": ["w1", "w2"],
        "anchors": {"w1": 0, "w2": 0},
    }


def test_a_slice_of_a_worker_left_out_is_dropped_on_every_shard(two_shards) -> None:
    """w2's slice reaches shard 1 but w2 never confirms and leaves: the step is w1's alone
    on both shards (b moves by 0.95 g_w1, not by the mean with w2's)."""
    (url0, _), (url1, follower) = two_shards
    register([url0, url1], "w1")
    register([url0, url1], "w2")
    assert submit(url1, "w2", {n: G["w2"][n] for n in ("b", "c")})[0] == 200
    assert submit(url0, "w1", {"a": G["w1"]["a"]})[0] == 200
    assert submit(url1, "w1", {n: G["w1"][n] for n in ("b", "c")})[0] == 200
    assert call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1")[0] == 200
    assert call(url0, "DELETE", "/v1/workers/w2")[0] == 200  # w2 leaves shard 0's barrier
    deadline = time.monotonic() + 20
    while follower.version < 1:
        assert time.monotonic() < deadline, "shard 1 never applied shard 0's decision"
        time.sleep(0.05)
    got1, _ = weights(url1)
    torch.testing.assert_close(got1["b"], torch.tensor([10.0 - 1.9, -10.0 - 3.8]))
    torch.testing.assert_close(got1["c"], torch.tensor([0.5 - 0.95]))
    got0, _ = weights(url0)
    torch.testing.assert_close(got0["a"], torch.tensor([1.0 - 0.95, 2.0, 3.0 + 0.95, 4.0 - 1.9]))


@pytest.mark.parametrize(
    ("method", "path", "fields", "status", "kind"),
    [
        ("GET", "/v1/shard/decisions/99", {}, 409, "future_round"),
        ("GET", "/v1/shard/decisions/-1", {}, 422, "invalid_request"),
        ("GET", "/v1/shard/decisions/99999999999999999999999", {}, 422, "invalid_request"),
        ("GET", "/v1/shard/decisions/0", {"wait": "1e9"}, 422, "invalid_request"),
        ("GET", "/v1/shard/prepared", {"round": "0"}, 422, "invalid_request"),
        ("GET", "/v1/shard/prepared", {"round": "x", "worker_id": "w1"}, 422, "invalid_request"),
        ("POST", "/v1/rounds/0/confirm", {"worker_id": "ghost"}, 404, "unknown_worker"),
        ("POST", "/v1/rounds/0/confirm", {}, 422, "invalid_request"),
    ],
)
def test_bad_shard_requests_are_refused_and_change_nothing(
    two_shards, method, path, fields, status, kind
) -> None:
    (url0, leader), _ = two_shards
    got, data = call(url0, method, path, **fields)
    assert got == status, data
    assert json.loads(data)["kind"] == kind
    assert leader.version == 0


def test_confirmations_and_decisions_are_shard_0s(two_shards) -> None:
    (url0, _), (url1, follower) = two_shards
    register([url0, url1], "w1")
    status, data = call(url1, "POST", "/v1/rounds/0/confirm", worker_id="w1")
    assert (status, json.loads(data)["kind"]) == (409, "not_shard_0")
    status, data = call(url1, "GET", "/v1/shard/decisions/0")
    assert (status, json.loads(data)["kind"]) == (409, "not_shard_0")
    status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1")
    assert (status, json.loads(data)["kind"]) == (409, "not_submitted")
    assert follower.version == 0


def wait_version(coordinator: Coordinator, version: int) -> None:
    deadline = time.monotonic() + 20
    while coordinator.version < version:
        assert time.monotonic() < deadline, "a shard never reached the version"
        time.sleep(0.05)


def test_a_worker_banned_after_it_confirmed_is_left_out_on_every_shard(two_shards) -> None:
    """w2 confirms, then an admin bans it before w1 is in: both shards step with w1's slices
    alone (0.95 g_w1), and the decision names w1 only."""
    (url0, _), (url1, follower) = two_shards
    register([url0, url1], "w1")
    register([url0, url1], "w2")
    for worker in ("w1", "w2"):
        assert submit(url0, worker, {"a": G[worker]["a"]})[0] == 200
        assert submit(url1, worker, {n: G[worker][n] for n in ("b", "c")})[0] == 200
    assert call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2")[0] == 200
    ban = json.dumps({"ban": True, "reason": "test"}).encode()
    status, data = call(url0, "POST", "/v1/admin/workers/w2/evict", ban)
    assert status == 200, data
    assert call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1")[0] == 200
    wait_version(follower, 1)
    got0, _ = weights(url0)
    got1, _ = weights(url1)
    torch.testing.assert_close(got0["a"], torch.tensor([1.0 - 0.95, 2.0, 3.0 + 0.95, 4.0 - 1.9]))
    torch.testing.assert_close(got1["b"], torch.tensor([10.0 - 1.9, -10.0 - 3.8]))
    torch.testing.assert_close(got1["c"], torch.tensor([0.5 - 0.95]))
    assert json_of(call(url0, "GET", "/v1/shard/decisions/0"))["contributors"] == ["w1"]


def test_a_confirmation_retried_after_its_round_committed_says_it_was_used(two_shards) -> None:
    (url0, _), (url1, follower) = two_shards
    register([url0, url1], "w1")
    register([url0, url1], "w2")
    assert submit(url0, "w1", {"a": G["w1"]["a"]})[0] == 200
    assert submit(url1, "w1", {n: G["w1"][n] for n in ("b", "c")})[0] == 200
    assert call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1")[0] == 200
    assert call(url0, "DELETE", "/v1/workers/w2")[0] == 200  # round 0 commits with w1 alone
    wait_version(follower, 1)
    again = json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1"))
    assert again["status"] == "duplicate"  # folded: the lost answer's retry must say so
    register([url0], "w2")
    late = json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2"))
    assert late["status"] == "committed"  # not in round 0's decision


def test_a_follower_takes_a_new_session_only_when_shard_0_holds_it(two_shards) -> None:
    """A worker restarted without its checkpoint registers under a new session: shard 0
    evicted the old one and admits it; the follower (which never evicts) takes the new
    session once shard 0 vouches for it, and refuses a session shard 0 does not hold."""
    (url0, _), (url1, _) = two_shards

    def join(url: str, session: str) -> tuple:
        message = {"protocol_version": 1, "worker_id": "w1", "tensors": SPECS, "session": session}
        return call(url, "POST", "/v1/workers", json.dumps(message).encode())

    assert join(url0, "old-session")[0] == 200
    assert join(url1, "old-session")[0] == 200
    status, data = join(url1, "new-session")  # shard 0 still holds the old one
    assert (status, json.loads(data)["kind"]) == (409, "worker_id_taken")
    assert call(url0, "DELETE", "/v1/workers/w1")[0] == 200  # shard 0's eviction of it
    assert join(url0, "new-session")[0] == 200
    status, data = join(url1, "new-session")
    assert status == 200, data
    assert json.loads(data)["worker_id"] == "w1"


def test_only_the_shard_secret_and_admin_may_read_the_shard_routes(two_shards_with_token) -> None:
    """Issue 28, item 2: the shards call each other with a secret of their own (scope shard
    of the tokens file); a worker's credential and the enrollment token are 403 there, and
    the shard secret registers and acts as no worker."""
    (url0, _), _ = two_shards_with_token
    body = json.dumps({"protocol_version": 1, "worker_id": "w1", "tensors": SPECS}).encode()
    status, data = call(url0, "POST", "/v1/workers", body, secret=TOKEN)
    assert status == 200, data
    credential = json.loads(data)["credential"]
    for path, fields in (
        ("/v1/shard/prepared", {"round": 0, "worker_id": "w1"}),
        ("/v1/shard/decisions/0", {}),
        ("/v1/shard/members", {"worker_id": "w1", "session": "x"}),
        ("/v1/shard/live", {}),
        ("/v1/shard/plan", {}),
    ):
        for secret, scope in ((credential, "worker:w1"), (TOKEN, "enroll")):
            status, data = call(url0, "GET", path, secret=secret, **fields)
            refused = json.loads(data)
            assert (status, refused["kind"]) == (403, "forbidden"), (path, scope)
            assert refused["detail"] == {"scope": scope, "required": "shard"}
            assert "the /v1/shard routes are for the shards' own secret" in refused["error"]
        status, data = call(url0, "GET", path, secret=None, **fields)
        assert status == 401, path
        for secret in (SHARD_SECRET, ADMIN_SECRET):
            status, data = call(url0, "GET", path, secret=secret, **fields)
            assert status == 200, (path, data)
    # a part of a screening: the shard secret only (an admin steers, but sums no tensors)
    part = json.dumps({"shard": 1, "kept": {}, "dots": {}, "squares": {},
                       "median_squares": 0.0}).encode()  # fmt: skip
    for secret, scope in ((credential, "worker:w1"), (TOKEN, "enroll"), (ADMIN_SECRET, "admin")):
        status, data = call(url0, "POST", "/v1/shard/screening/0", part, secret=secret)
        assert (status, json.loads(data)["kind"]) == (403, "forbidden"), (scope, data)
    status, data = call(url0, "POST", "/v1/shard/screening/0", part, secret=SHARD_SECRET)
    assert (status, json.loads(data)["kind"]) == (409, "screening_changed"), data  # none open
    other = json.dumps({"protocol_version": 1, "worker_id": "w2", "tensors": SPECS}).encode()
    status, data = call(url0, "POST", "/v1/workers", other, secret=SHARD_SECRET)
    assert (status, json.loads(data)["kind"]) == (403, "forbidden"), data
    assert "a shard secret registers no worker" in json.loads(data)["error"]
    status, data = call(url0, "POST", "/v1/workers/w1/heartbeat", b"{}", secret=SHARD_SECRET)
    assert status == 403, data  # acts as no worker either
    assert [
        w["worker_id"]
        for w in json.loads(call(url0, "GET", "/v1/status", secret=SHARD_SECRET)[1])["workers"]
    ] == ["w1"]


def test_a_follower_refuses_to_be_steered(two_shards) -> None:
    """Bans, evictions, pauses and the outer lr are shard 0's: one shard alone would fold
    other slices than the decision names."""
    (_, _), (url1, follower) = two_shards
    register([url1], "w1")
    ban = json.dumps({"ban": True}).encode()
    for path, body in (
        ("/v1/admin/workers/w1/evict", ban),
        ("/v1/admin/pause", None),
    ):
        status, data = call(url1, "POST", path, body)
        assert (status, json.loads(data)["kind"]) == (409, "not_shard_0"), path
    assert follower.membership.is_live("w1")


def test_a_new_process_under_the_same_id_replaces_its_old_slices_everywhere(two_shards) -> None:
    """w1's first process sent shard 1 a slice and died; shard 0 evicted it. Its new process
    (another session) sends other values: shard 1 takes them in place of the old slice, and
    the step is the new process's alone on both shards (0.95 x its g, worked by hand)."""
    (url0, _), (url1, follower) = two_shards

    def join(url: str, session: str) -> None:
        message = {"protocol_version": 1, "worker_id": "w1", "tensors": SPECS, "session": session}
        status, data = call(url, "POST", "/v1/workers", json.dumps(message).encode())
        assert status == 200, data

    join(url0, "first-session")
    join(url1, "first-session")
    assert submit(url1, "w1", {n: G["w1"][n] for n in ("b", "c")})[0] == 200
    assert call(url0, "DELETE", "/v1/workers/w1")[0] == 200
    join(url0, "second-session")
    join(url1, "second-session")
    new = G["w2"]  # the new process's pseudo-gradient
    assert submit(url0, "w1", {"a": new["a"]})[0] == 200
    assert submit(url1, "w1", {n: new[n] for n in ("b", "c")})[0] == 200
    assert json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1"))["status"] == (
        "accepted"
    )
    wait_version(follower, 1)
    got1, _ = weights(url1)
    torch.testing.assert_close(got1["b"], torch.tensor([10.0, -10.0 + 3.8]))
    torch.testing.assert_close(got1["c"], torch.tensor([0.5 + 2.85]))


def test_sync_shards_take_int8_both_ways_as_one_server_would(two_int8_shards) -> None:
    """Issue 28, item 1: each shard takes its tensors' parts of an int8 body (the codec in
    every slice's header), the round commits the hand-computed step on both, and each shard
    codes its tensors' int8 delta, which joined move a worker's anchor to the weights. Each
    tensor's largest |value| is 127, so its scale is 1 and every value decodes exactly:
    mean g: a [65, 63.5, 0, 1], b [63.5, -62.5], c [0]; nesterov lr 0.5, mu 0.9, first
    step: G - 0.95 g."""
    from diloco.algorithm.compression.codecs import Codec
    from diloco.wire.compressed.body import encode_compressed, split_body

    (url0, leader), (url1, follower) = two_int8_shards
    codec = Codec("int8", block=8)
    sent = {
        "w1": {"a": [127.0, 0.0, -1.0, 2.0], "b": [127.0, 2.0], "c": [127.0]},
        "w2": {"a": [3.0, 127.0, 1.0, 0.0], "b": [0.0, -127.0], "c": [-127.0]},
    }
    register([url0, url1], "w1")
    register([url0, url1], "w2")
    for worker, values in sent.items():
        body = encode_compressed({n: torch.tensor(v) for n, v in values.items()}, codec)
        slices = split_body(body, OWNED)
        # a slice without the codec's metadata is refused, naming it, and changes nothing
        plain = save({n: torch.tensor(values[n]) for n in OWNED[1]})
        status, data = call(url1, "POST", "/v1/rounds/0/submissions", plain, worker_id=worker)
        assert status == 422 and json.loads(data)["kind"] == "codec_mismatch", data
        for url, part in zip((url0, url1), slices, strict=True):
            status, data = call(url, "POST", "/v1/rounds/0/submissions", bytes(part),
                                worker_id=worker)  # fmt: skip
            assert status == 200, data
        confirmed = json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id=worker))
        assert confirmed["status"] == "accepted", confirmed
    expected = {
        "a": torch.tensor([1.0 - 0.95 * 65, 2.0 - 0.95 * 63.5, 3.0, 4.0 - 0.95]),
        "b": torch.tensor([10.0 - 0.95 * 63.5, -10.0 + 0.95 * 62.5]),
        "c": torch.tensor([0.5]),
    }
    deadline = time.monotonic() + 20
    while follower.version < 1:
        assert time.monotonic() < deadline, "shard 1 never applied shard 0's decision"
        time.sleep(0.05)
    # the masters moved to `expected`; what workers hold (and a full download gives) is the
    # published copy P, moved by each shard's int8 delta of its tensors: within one int8
    # step of the masters (what it held back goes with the next delta)
    masters = {**leader.model.masters, **follower.model.masters}
    for name, tensor in masters.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-5, msg=name)
    got0, round0 = weights(url0)
    got1, round1 = weights(url1)
    assert (round0, round1) == (1, 1)
    published = {**got0, **got1}
    for name, tensor in published.items():
        step = float((expected[name] - INITIAL[name]).abs().max()) / 127
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=step + 1e-5, msg=name)
    assert not torch.equal(published["a"], INITIAL["a"])
    # a worker whose anchor is round 0's gets each shard's delta, and joined they move its
    # anchor to exactly P
    from diloco.wire.compressed.body import apply_delta, join_bodies

    deltas = []
    for url in (url0, url1):
        answer = HTTP.request("GET", f"{url}/v1/rounds/0/result?worker_id=w1&wait=5&have=0",
                              headers=PROTOCOL)  # fmt: skip
        assert answer.status == 200 and answer.headers["X-Diloco-Delta-From"] == "0"
        deltas.append(answer.data)
    anchor = {name: tensor.clone() for name, tensor in INITIAL.items()}
    apply_delta(join_bodies(deltas), anchor, codec)
    for name, tensor in anchor.items():
        assert torch.equal(tensor, published[name]), name


@pytest.fixture
def two_sparse_mean_shards() -> Iterator[list[tuple[str, Coordinator]]]:
    yield from started_shards(None, aggregation="sparse_mean")


def test_sync_shards_average_each_element_over_its_senders(two_sparse_mean_shards) -> None:
    """Issue 28, item 1: under sparse_mean each shard divides each element of its tensors by
    the workers that sent it (a value other than 0), as one server does. sparse mean g:
    a [(1+3)/2, 2/1, (-1+1)/2, 2/1] = [2, 2, 0, 2], b [2/1, (4-4)/2] = [2, 0], c [-1]
    (the plain mean would give a [2, 1, 0, 1], b [1, 0]); nesterov lr 0.5, mu 0.9, first
    step: G - 0.95 g."""
    (url0, _), (url1, follower) = two_sparse_mean_shards
    for worker in ("w1", "w2"):
        register([url0, url1], worker)
    for worker in ("w1", "w2"):
        for url, names in zip((url0, url1), OWNED, strict=True):
            status, data = submit(url, worker, {n: G[worker][n] for n in names})
            assert status == 200, data
        confirmed = json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id=worker))
        assert confirmed["status"] == "accepted", confirmed
    expected = {
        "a": torch.tensor([1.0 - 1.9, 2.0 - 1.9, 3.0, 4.0 - 1.9]),
        "b": torch.tensor([10.0 - 1.9, -10.0]),
        "c": torch.tensor([0.5 + 0.95]),
    }
    wait_version(follower, 1)
    got0, _ = weights(url0)
    got1, _ = weights(url1)
    for name, tensor in {**got0, **got1}.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    info = json_of(call(url1, "GET", "/v1/info"))
    assert info["settings"]["aggregation"] == "sparse_mean"
