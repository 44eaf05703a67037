"""ShardedClient in sync mode with a download codec: the shards' coded deltas joined into one
when every shard sent one against our anchor's round; whole weights when any did not. A
shard sends a delta only when the worker's anchor is its last step's start, which real shards
cannot be made to disagree on at will, so the shards here are scripted stand-ins; the real
path runs in tests/e2e/test_e2e_shards.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco.algorithm.compression.codecs import Codec
from diloco.wire import decode_tensors, encode_tensors
from diloco.wire.compressed.body import encode_compressed, join_bodies
from diloco.wire.format.frames import decode_frame
from diloco.worker.errors import ServerError
from diloco.worker.net.client import Weights
from diloco.worker.net.sharded_servers import ShardedClient

CODEC = Codec("int8", block=8)


class DeltaShard:
    """Answers a result: a coded delta against `have` when it `sends_delta` and was asked for
    one, else its whole weights."""

    def __init__(self, name: str, sends_delta: bool) -> None:
        self.name = name
        self.sends_delta = sends_delta
        self.asked: list[int | None] = []  # the `have` of each call
        self.last_waiting: dict[str, Any] = {}
        self.auth = None
        self.base_url = f"http://{name}.invalid"

    def wait_result(self, round: int, worker_id: str, wait: float, **options: Any):
        have = options.get("have")
        self.asked.append(have)
        if have is not None and self.sends_delta:
            delta = encode_compressed({self.name: torch.tensor([127.0, -1.0])}, CODEC)
            return Weights(delta, round + 1, delta_from=have)
        return Weights(encode_tensors({self.name: torch.tensor([5.0, 6.0])}), round + 1)

    def close(self) -> None:
        pass


def test_every_shard_s_delta_is_joined_into_one_under_the_codec() -> None:
    a, b = DeltaShard("a", True), DeltaShard("b", True)
    got = ShardedClient([a, b]).wait_result(3, "w1", 0.0, have=3)  # type: ignore[list-item]
    assert got is not None and (got.round, got.delta_from) == (4, 3)
    entries, metadata = decode_frame(got.body)
    assert set(entries) == {"a#codes", "a#scales", "b#codes", "b#scales"}
    assert metadata["diloco.codec"] == "int8" and a.asked == [3] and b.asked == [3]


def test_a_shard_that_sent_whole_weights_makes_every_shard_send_its_own() -> None:
    a, b = DeltaShard("a", True), DeltaShard("b", False)
    got = ShardedClient([a, b]).wait_result(3, "w1", 0.0, have=3)  # type: ignore[list-item]
    assert got is not None and (got.round, got.delta_from) == (4, None)
    whole = {name: t.tolist() for name, t in decode_tensors(got.body).items()}
    assert whole == {"a": [5.0, 6.0], "b": [5.0, 6.0]}  # both shards' weights, plain
    assert a.asked == [3, None]  # asked again, for its weights


def test_joining_bodies_that_disagree_is_refused_naming_why() -> None:
    coded = encode_compressed({"a": torch.tensor([1.0])}, CODEC)
    plain = encode_tensors({"b": torch.tensor([1.0])})
    with pytest.raises(ValueError, match="disagree on their metadata"):
        join_bodies([coded, plain])
    with pytest.raises(ValueError, match="entry 'a#codes' came from two shards"):
        join_bodies([coded, coded])
    with pytest.raises(ServerError) as refused:
        ShardedClient._join([bytearray(coded), bytearray(plain)])
    assert refused.value.kind == "invalid_response"
