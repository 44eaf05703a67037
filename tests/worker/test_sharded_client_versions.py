"""ShardedClient in async mode: every shard's part of exactly the version shard 0 answered
with. Real shards cannot be made to move on between two downloads on cue, so the shards here
are scripted stand-ins that answer as docs/protocol.md says a shard does ("Async mode across
shards"); the real path runs in tests/e2e/test_e2e_shard_async.py."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch

from diloco.wire import decode_tensors, encode_tensors
from diloco.worker.errors import ServerError
from diloco.worker.net import sharded_servers as sharded_client
from diloco.worker.net.client import Weights
from diloco.worker.net.sharded_servers import ShardedClient


class ScriptedShard:
    """Answers wait_result from a script: Weights of a version, or an error kind."""

    def __init__(self, name: str, script: list[int | str]) -> None:
        self.name = name
        self.script = deque(script)
        self.asked: list[int | None] = []  # the `version` each call named
        self.last_waiting: dict[str, Any] = {}
        self.auth = None
        self.base_url = f"http://{name}.invalid"

    def wait_result(self, round: int, worker_id: str, wait: float, **options: Any):
        self.asked.append(options.get("version"))
        step = self.script.popleft()
        if isinstance(step, str):
            raise ServerError(409, step, f"scripted {step}")
        body = encode_tensors({self.name: torch.full((2,), float(step))})
        return Weights(body, step)

    def close(self) -> None:
        pass


def client_of(*shards: ScriptedShard) -> ShardedClient:
    return ShardedClient(shards, mode="async")  # type: ignore[arg-type]


def test_every_follower_is_asked_for_shard_0s_version() -> None:
    leader, follower = ScriptedShard("a", [7]), ScriptedShard("b", [7])
    got = client_of(leader, follower).wait_result(3, "w1", 0.0)
    assert got is not None and got.round == 7
    assert follower.asked == [7] and leader.asked == [None]
    assert decode_tensors(got.body)["b"].tolist() == [7.0, 7.0]


def test_a_follower_past_what_it_keeps_sends_the_worker_back_to_shard_0(monkeypatch) -> None:
    monkeypatch.setattr(sharded_client.time, "sleep", lambda _s: None)
    leader = ScriptedShard("a", [7, 12])
    follower = ScriptedShard("b", ["version_gone", 12])
    got = client_of(leader, follower).wait_result(3, "w1", 0.0)
    assert got is not None and got.round == 12
    assert follower.asked == [7, 12]  # again, with shard 0's newer version
    tensors = decode_tensors(got.body)
    assert tensors["a"].tolist() == tensors["b"].tolist() == [12.0, 12.0]  # one version


def test_shards_that_never_share_a_version_end_in_shards_apart(monkeypatch) -> None:
    clock = iter(range(0, 10_000, 50))  # 50 s per look at the clock
    monkeypatch.setattr(sharded_client.time, "sleep", lambda _s: None)
    monkeypatch.setattr(sharded_client.time, "monotonic", lambda: float(next(clock)))
    leader = ScriptedShard("a", list(range(100)))
    follower = ScriptedShard("b", ["version_gone"] * 100)
    with pytest.raises(ServerError) as caught:
        client_of(leader, follower).wait_result(3, "w1", 0.0)
    assert caught.value.kind == "shards_apart"
    assert len(follower.asked) < 10  # bounded by SAME_VERSION_SECONDS, not by the script
