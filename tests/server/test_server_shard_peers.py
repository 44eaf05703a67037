"""What a shard takes from another shard's answers (server/shards/peers.py), against a fake
shard on loopback that answers whatever JSON a test gives it: a malformed answer is a
`PeerUnavailable` (the caller's retryable 503), never a decision applied half understood."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from diloco.server.shards.peers import PeerUnavailable, ShardPeers


class FakeShard:
    """A shard 0 answering every GET with `answer` (JSON text, NaN allowed as Python writes
    it); `asked` collects the paths with their queries."""

    def __init__(self) -> None:
        self.answer = "{}"
        self.asked: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.asked.append(self.path)
                body = fake.answer.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def shard0() -> Iterator[tuple[FakeShard, ShardPeers]]:
    fake = FakeShard()
    peers = ShardPeers([fake.url, "http://127.0.0.1:9"], 1)  # we are shard 1
    yield fake, peers
    peers.close()
    fake.close()


DECIDED = {"status": "decided", "round": 0, "contributors": ["w1", "w2"],
           "anchors": {"w1": 0, "w2": 0}, "sessions": {"w1": "d1", "w2": "d2"}}  # fmt: skip


def test_a_screened_decision_is_read_with_its_scales_and_norms(shard0) -> None:
    fake, peers = shard0
    fake.answer = json.dumps({**DECIDED, "scales": {"w1": 1.0, "w2": 0.25},
                              "norms": {"w1": 3.0, "w2": 12.0}})  # fmt: skip
    decision = peers.decision(0, 0.0)
    assert decision is not None and decision.contributors == {"w1": (0, "d1"), "w2": (0, "d2")}
    assert decision.screened is not None
    assert decision.screened.scales == {"w1": 1.0, "w2": 0.25}
    assert decision.screened.norms == {"w1": 3.0, "w2": 12.0}
    assert decision.screened.refused() == {}
    assert "shard=1" in fake.asked[-1]  # it says who asks, so a screening can ask it back
    fake.answer = json.dumps({"status": "screening", "round": 0, "kept": {"w1": "d1"}})
    asked = peers.decision(0, 0.0)
    assert asked is not None and asked.screening == {"w1": "d1"} and asked.contributors is None
    fake.answer = json.dumps(DECIDED)  # a step of the mean: nothing screened
    mean = peers.decision(0, 0.0)
    assert mean is not None and mean.screened is None


@pytest.mark.parametrize(
    "extra",
    [
        {"scales": {"w1": 1.5}},  # a scale above 1
        {"scales": {"w1": -0.5}},
        {"scales": {"w1": True}},
        {"scales": {"w9": 1.0}},  # a worker the decision does not name
        {"scales": {"w1": 1.0}, "norms": {"w9": 1.0}},
        {"scales": {"w1": 1.0}, "norms": {"w1": "3"}},
        {"scales": []},
        {"scales": {"w1": float("nan")}},
        {"scales": {"w1": 1.0}, "norms": {"w1": float("inf")}},
    ],
    ids=str,
)
def test_a_malformed_screened_decision_is_refused(shard0, extra: dict) -> None:
    fake, peers = shard0
    fake.answer = json.dumps({**DECIDED, **extra})  # (Python writes NaN and Infinity)
    with pytest.raises(PeerUnavailable, match="malformed"):
        peers.decision(0, 0.0)


def test_a_screening_request_without_its_slices_is_refused(shard0) -> None:
    fake, peers = shard0
    for kept in (None, ["w1"], {"w1": 3}):
        fake.answer = json.dumps({"status": "screening", "round": 0, "kept": kept})
        with pytest.raises(PeerUnavailable, match="malformed"):
            peers.decision(0, 0.0)


PREPARED = {"round": 0, "current_round": 0, "worker_id": "w1", "prepared": True, "tokens": 7,
            "session_digest": "d1", "bound": 2.0}  # fmt: skip


@pytest.mark.parametrize("squares", [None, -1.0, math.inf, "4", True])
def test_a_robust_confirmation_needs_every_shards_sum_of_squares(shard0, squares) -> None:
    """Under a robust rule the other shards' squares make each worker's whole norm: one
    that states none (or no number >= 0) is a 503 at the confirmation, not a silent 0.
    Under the mean they are not asked for."""
    fake, _ = shard0
    peers = ShardPeers(["http://127.0.0.1:9", fake.url], 0)  # shard 0 asks shard 1
    try:
        fake.answer = json.dumps({**PREPARED, "norm_squares": squares})
        assert peers.missing_slices(0, "w1", 7, "d1") == ([], 2.0, 0.0)
        with pytest.raises(PeerUnavailable, match="sum of squares"):
            peers.missing_slices(0, "w1", 7, "d1", screened=True)
        fake.answer = json.dumps({**PREPARED, "norm_squares": 4.0})
        assert peers.missing_slices(0, "w1", 7, "d1", screened=True) == ([], 2.0, 4.0)
    finally:
        peers.close()
