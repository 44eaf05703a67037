"""Cross-shard cases an outside review found, over raw HTTP on two async shards (the harness
and layout of test_server_http_shard_async.py: a -> shard 0, b and c -> shard 1).

- Values that could overflow some shard's fp32 sums are refused when shard 0 confirms them
  (it knows every shard's bound then), not when each shard folds: no shard applies a step
  another cannot.
- A worker restarted without its checkpoint (a new session under its id) sends a slice of an
  anchor whose older slice shard 0 already confirmed: every shard folds the older process's
  slice, the one the decision names by its session digest.
- A refused body changes nothing: a slice held before it stays held.
Expected weights by hand: Nesterov with lr 1 and momentum 0.5 (dn-period 1), a first step is
theta - 1.5 g, for a window the mean of its arrivals.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from test_server_http_shard_async import (
    OWNED,
    G,
    Shard,
    async_shards,
    at_version,
    confirm,
    refusal,
    send_slice,
    send_slices,
    whole_model,
)
from test_server_http_shards import INITIAL, SPECS, call, json_of, register, started_shards


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., list[Shard]]]:
    """`start(grace_seconds=30, ...)`: two async shards with these settings; stopped after."""
    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(async_shards(tmp_path, **overrides))


@pytest.fixture
def two_shards():
    yield from started_shards(None)


def join(url: str, worker_id: str, session: str) -> tuple[int, bytes]:
    body = {"protocol_version": 1, "worker_id": worker_id, "tensors": SPECS, "session": session}
    return call(url, "POST", "/v1/workers", json.dumps(body).encode())


def test_values_that_could_overflow_a_followers_sums_are_refused_at_the_confirmation(
    start,
) -> None:
    """b lives on shard 1: 6e36 twice would pass 1e37 (FINITE_SUM_LIMIT) in shard 1's sums,
    while shard 0's own values are small; shard 0 refuses the second confirmation."""
    shards = start(grace_seconds=30.0)
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    big = {"a": torch.ones(4), "b": torch.tensor([6e36, 0.0]), "c": torch.ones(1)}
    for worker in ("w1", "w2"):
        send_slices(shards, worker, 0, big)
    status, answer = confirm(shard0, "w1", 0)
    assert status == 200 and answer["applied_version"] is None, answer
    status, answer = confirm(shard0, "w2", 0)
    detail = refusal(status, answer, 422, "sum_overflow")
    assert detail == {"bound": torch.tensor(6e36).item(), "limit": 1e37}  # 6e36 in fp32
    assert [s.coordinator.version for s in shards] == [0, 0]
    # w2 is not in the window (nothing changed): the window still waits for it
    assert json_of(call(shard0.url, "GET", "/v1/status"))["waiting_for"] == ["w2"]
    # w2 leaves: the window closes with w1 alone, on both shards
    status, data = call(shard0.url, "POST", "/v1/admin/workers/w2/evict", b"{}")
    assert status == 200, data
    at_version(shards, 1)
    model = whole_model(shards, 1)
    for name in ("a", "b", "c"):  # theta - 1.5 g1, in fp32
        torch.testing.assert_close(model[name], INITIAL[name] - 1.5 * big[name], msg=name)
    assert model["a"].tolist() == [-0.5, 0.5, 1.5, 2.5]


def test_a_restarted_workers_new_slice_does_not_replace_the_confirmed_one_anywhere(
    start,
) -> None:
    shards = start(grace_seconds=30.0)
    shard0, shard1 = shards
    for url in (shard0.url, shard1.url):
        assert join(url, "w1", "old-session")[0] == 200
        assert join(url, "w2", "w2-session")[0] == 200
    send_slices(shards, "w1", 0, G["w1"])
    status, answer = confirm(shard0, "w1", 0)
    assert status == 200 and answer["applied_version"] is None, answer
    status, data = call(shard0.url, "POST", "/v1/admin/workers/w1/evict", b"{}")
    assert status == 200, data
    # the worker comes back without its checkpoint: a new session, the same anchor 0
    assert join(shard0.url, "w1", "new-session")[0] == 200
    assert join(shard1.url, "w1", "new-session")[0] == 200
    answers = [
        send_slice(shard.url, "w1", 0, {n: G["w3"][n] for n in owned})
        for shard, owned in zip(shards, OWNED, strict=True)
    ]
    assert answers[0]["status"] == "duplicate"  # shard 0: that arrival is in its window
    assert answers[1]["status"] == "accepted"  # shard 1: held beside the older one
    send_slices(shards, "w2", 0, G["w2"])
    assert confirm(shard0, "w2", 0)[0] == 200
    at_version(shards, 1)
    model = whole_model(shards, 1)
    for name in ("a", "b", "c"):  # g1, not g3, on both shards
        expected = INITIAL[name] - 1.5 * (G["w1"][name] + G["w2"][name]) / 2
        torch.testing.assert_close(model[name], expected, msg=name)


def test_a_refused_body_leaves_a_held_slice_held(start) -> None:
    shards = start()
    shard0, shard1 = shards
    for worker in ("w1", "w2"):
        register([shard0.url, shard1.url], worker)
    send_slices(shards, "w2", 0, G["w2"])
    assert confirm(shard0, "w2", 0)[0] == 200
    at_version(shards, 1)
    send_slices(shards, "w1", 0, G["w1"])  # held, not confirmed yet
    nan = save({"a": torch.tensor([float("nan"), 0.0, 0.0, 0.0])})
    status, data = call(shard0.url, "POST", "/v1/rounds/1/submissions", nan, worker_id="w1")
    assert status == 422, data
    status, answer = confirm(shard0, "w1", 0)  # still held on shard 0
    assert status == 200 and answer["applied_version"] == 1 and answer["staleness"] == 1, answer
    at_version(shards, 2)


def test_the_outer_lr_of_a_sharded_run_is_not_changed_on_shard_0_alone(start) -> None:
    """Followers step with their own lr: setting it on shard 0 alone would step the shards
    apart, so it is refused (the reviewer saw a step with 0.5 on a and 1.0 on b, c)."""
    shards = start()
    shard0, shard1 = shards
    register([shard0.url, shard1.url], "w1")
    body = json.dumps({"outer_lr": 0.5}).encode()
    status, data = call(shard0.url, "PUT", "/v1/admin/outer-lr", body)
    assert refusal(status, data, 409, "not_built") == {"action": "the outer lr"}
    send_slices(shards, "w1", 0, G["w1"])
    assert confirm(shard0, "w1", 0)[0] == 200
    at_version(shards, 1)
    model = whole_model(shards, 1)
    for name in ("a", "b", "c"):  # lr 1 everywhere: theta - 1.5 g
        torch.testing.assert_close(model[name], INITIAL[name] - 1.5 * G["w1"][name], msg=name)


def test_sync_a_follower_folds_the_slice_shard_0_confirmed_not_a_newer_processs(
    two_shards,
) -> None:
    """Sync rounds: w1's first process confirms round 0; shard 0 evicts it, and its new
    process (another session) sends shard 1 other values. Shard 1 sets the older slice aside,
    and takes it back when the decision names its session: both shards fold g1 (with w2's
    g2). Settings of test_server_http_shards.py: Nesterov, lr 0.5, momentum 0.9, so a first
    step is G - 0.95 mean(g)."""
    from test_server_http_shards import G as SYNC_G
    from test_server_http_shards import submit, wait_version

    (url0, leader), (url1, follower) = two_shards
    for url in (url0, url1):
        assert join(url, "w1", "first-session")[0] == 200
        assert join(url, "w2", "w2-session")[0] == 200
    g1, g2 = SYNC_G["w1"], SYNC_G["w2"]
    assert submit(url0, "w1", {"a": g1["a"]})[0] == 200
    assert submit(url1, "w1", {n: g1[n] for n in ("b", "c")})[0] == 200
    answer = json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1"))
    assert answer["status"] == "accepted"
    assert call(url0, "POST", "/v1/admin/workers/w1/evict", b"{}")[0] == 200
    for url in (url0, url1):
        assert join(url, "w1", "second-session")[0] == 200
    newer = {n: 100 * t for n, t in g2.items()}
    status, data = submit(url1, "w1", {n: newer[n] for n in ("b", "c")})
    assert status == 200 and json.loads(data)["status"] == "accepted", data
    for url, names in ((url0, ("a",)), (url1, ("b", "c"))):
        assert submit(url, "w2", {n: g2[n] for n in names})[0] == 200
    assert json_of(call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w2"))["status"] == (
        "accepted"
    )
    wait_version(leader, 1)
    wait_version(follower, 1)
    decision = json_of(call(url0, "GET", "/v1/shard/decisions/0"))
    assert decision["contributors"] == ["w1", "w2"]
    for url, names in ((url0, ("a",)), (url1, ("b", "c"))):
        from test_server_http_shards import weights as sync_weights

        got, version = sync_weights(url)
        assert version == 1
        for name in names:
            expected = INITIAL[name] - 0.95 * (g1[name] + g2[name]) / 2
            torch.testing.assert_close(got[name], expected, msg=name)
