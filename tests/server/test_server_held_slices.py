"""A sync follower shard's held slices survive its restart (server/state/held_slices.py).

Shard 0 decides a round from slices every shard said it held; a follower that restarts before
it folds them takes them back from its state dir, so a decided worker that died too is never
needed again. Expected weights are worked by hand as in test_server_http_shards.py: the mean
of w1's and w2's slices of b and c is b [1, 0], c [-1]; Nesterov lr 0.5, momentum 0.9, first
step (buf = g): G -= 0.95 g.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save
from test_server_http_shards import (
    INITIAL,
    OWNED,
    G,
    call,
    register,
    serve_in_thread,
    submit,
)

from diloco.server.coordinator import Coordinator
from diloco.server.ops.launch import free_ports
from diloco.server.settings import ServerSettings
from diloco.server.shards.peers import DecisionFollower, ShardPeers
from diloco.server.shards.sync_decisions import FollowerRound
from diloco.server.state.held_slices import HeldSlices
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import HELD_SLICES_NAME, StateStore
from diloco.wire.format.frames import read_frame_header
from diloco.wire.format.spool import SpooledTensors, SpoolFiles

EXPECTED_B_C = {"b": torch.tensor([10.0 - 0.95, -10.0]), "c": torch.tensor([0.5 + 0.95])}


class Cluster:
    """Shard 0 served in a thread (no state dir); shard 1 served with a state dir and no
    decision follower, so it holds its slices until the test restarts it."""

    def __init__(self, root: Path, **overrides) -> None:
        self.overrides = overrides
        self.ports = ports = free_ports(2)
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.root = root
        self.servers: list = []
        self.peers = [ShardPeers(self.urls, shard, None) for shard in range(2)]
        self.leader = Coordinator(
            self.settings(0), {"a": INITIAL["a"].clone()}, peers=self.peers[0]
        )
        self._serve(self.leader, ports[0])
        self.follower = Coordinator(
            self.settings(1),
            {name: INITIAL[name].clone() for name in OWNED[1]},
            journal=self.journal(),
            peers=self.peers[1],
        )
        self.follower_server = self._serve(self.follower, ports[1])
        self.decisions: DecisionFollower | None = None

    def settings(self, shard: int) -> ServerSettings:
        return ServerSettings(
            **{
                "outer_optimizer": "nesterov",
                "outer_lr": 0.5,
                "outer_momentum": 0.9,
                "min_workers": 1,
                **self.overrides,
            },
            shard=shard,
            shard_urls=tuple(self.urls),
        )

    def journal(self) -> RoundJournal:
        return RoundJournal(StateStore(self.root / "shard-1"), self.settings(1))

    @property
    def held_dir(self) -> Path:
        return self.root / "shard-1" / HELD_SLICES_NAME

    def _serve(self, coordinator: Coordinator, port: int):
        server, thread = serve_in_thread(coordinator, port, None)
        self.servers.append((server, thread))
        return server, thread

    def stop_follower(self) -> None:
        """Shard 1 stops serving and its state dir is let go; what it held in memory is lost
        with the object, as with a kill (its disk is what a kill leaves: the state at round
        0 and the held slices)."""
        server, thread = self.follower_server
        server.should_exit = True
        thread.join(timeout=15)

    def restart_follower(self) -> Coordinator:
        """A new shard 1 on the same state dir and port, following shard 0's decisions."""
        self.follower = Coordinator(self.settings(1), journal=self.journal(), peers=self.peers[1])
        self.follower_server = self._serve(self.follower, self.ports[1])
        shard = self.follower.shard
        assert shard is not None
        self.decisions = DecisionFollower(self.peers[1], shard, wait=1)
        self.decisions.start()
        return self.follower

    def stop(self) -> None:
        if self.decisions is not None:
            self.decisions.stop()
            self.decisions.join(timeout=15)
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(timeout=15)
        for peers in self.peers:
            peers.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path)
    yield started
    started.stop()


@pytest.fixture
def async_cluster(tmp_path: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path, mode="async", outer_lr=1.0, outer_momentum=0.5)
    yield started
    started.stop()


def decided_round_0(cluster: Cluster) -> None:
    """w1 and w2 send their slices to both shards and confirm; shard 0 decides round 0."""
    url0, url1 = cluster.urls
    for worker in ("w1", "w2"):
        register([url0, url1], worker)
    for worker in ("w1", "w2"):
        assert submit(url0, worker, {"a": G[worker]["a"]})[0] == 200
        assert submit(url1, worker, {n: G[worker][n] for n in OWNED[1]})[0] == 200
    for worker in ("w1", "w2"):
        status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id=worker)
        assert status == 200, data
    wait_version(cluster.leader, 1)


def wait_version(coordinator: Coordinator, version: int, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while coordinator.version < version:
        assert time.monotonic() < deadline, f"version {coordinator.version}, not {version}"
        time.sleep(0.05)


def restarted_applies_round_0(cluster: Cluster) -> None:
    """Shard 1 restarted applies round 0 from the slices it held: b and c by hand."""
    cluster.stop_follower()
    follower = cluster.restart_follower()
    wait_version(follower, 1)
    masters = follower.masters
    assert masters is not None
    for name, expected in EXPECTED_B_C.items():
        torch.testing.assert_close(masters[name], expected, rtol=0, atol=1e-6, msg=name)


def test_a_restarted_follower_applies_a_decision_from_the_slices_it_held(cluster) -> None:
    decided_round_0(cluster)
    assert cluster.follower.version == 0  # it never learned the decision
    assert len(list(cluster.held_dir.glob("*.json"))) == 2
    # No worker sends anything again: the restarted shard has every slice the decision names.
    restarted_applies_round_0(cluster)
    # the next round's first slice: the files of round 0, which the step folded, go
    body = save({n: G["w1"][n] for n in OWNED[1]})
    status, data = call(cluster.urls[1], "POST", "/v1/rounds/1/submissions", body, worker_id="w1")
    assert status == 200, data
    (record,) = cluster.held_dir.glob("*.json")
    assert json.loads(record.read_text())["round"] == 1
    assert len(list(cluster.held_dir.iterdir())) == 2


def test_a_slice_of_a_worker_that_left_before_the_restart_is_still_taken_back(cluster) -> None:
    """w2 leaves shard 1 after shard 0 decided the round with its slice: a running follower
    keeps a departed worker's slice, and so does a restarted one (else it would wait for a
    slice nobody can send)."""
    decided_round_0(cluster)
    assert call(cluster.urls[1], "DELETE", "/v1/workers/w2")[0] == 200
    restarted_applies_round_0(cluster)


def test_a_slice_the_disk_cannot_take_is_503_and_nothing_is_held(cluster, monkeypatch) -> None:
    url0, url1 = cluster.urls
    register([url0, url1], "w1")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    store = cluster.follower.held_slices
    assert store is not None
    with monkeypatch.context() as patched:
        patched.setattr(store, "prepare", full_disk)
        status, data = submit(url1, "w1", {n: G["w1"][n] for n in OWNED[1]})
    assert (status, json.loads(data)["kind"]) == (503, "spool_unavailable"), data
    assert "No space left on device" in json.loads(data)["error"]
    current = cluster.follower.round
    assert current is not None and current.held == [] and not current.submitted
    assert list(cluster.held_dir.iterdir()) == []
    assert submit(url1, "w1", {n: G["w1"][n] for n in OWNED[1]})[0] == 200  # the retry
    assert len(list(cluster.held_dir.glob("*.json"))) == 1


def test_slices_of_committed_rounds_are_gone_after_the_next_restart(cluster) -> None:
    decided_round_0(cluster)
    cluster.stop_follower()
    wait_version(cluster.restart_follower(), 1)
    cluster.decisions.stop()  # type: ignore[union-attr]
    cluster.decisions.join(timeout=15)  # type: ignore[union-attr]
    cluster.decisions = None
    cluster.stop_follower()
    follower = Coordinator(cluster.settings(1), journal=cluster.journal(), peers=cluster.peers[1])
    assert follower.version == 1
    assert os.listdir(cluster.held_dir) == []
    assert follower.round is not None and follower.round.held == []
    follower.journal.close()


def test_a_damaged_held_slice_is_dropped_and_asked_for_again(cluster, caplog) -> None:
    decided_round_0(cluster)
    cluster.stop_follower()
    records = sorted(cluster.held_dir.glob("*.json"))
    second = json.loads(records[1].read_text())
    assert second["worker_id"] == "w2" and second["round"] == 0
    body = records[1].with_suffix(".body")
    damaged = bytearray(body.read_bytes())
    damaged[-1] ^= 0x40  # a bit of a value flipped on the disk: the same size
    body.write_bytes(bytes(damaged))
    (cluster.held_dir / ".body.tmp-0123").write_bytes(b"half a copy")  # a crash's leftover
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        follower = cluster.restart_follower()
    warnings = [r.getMessage() for r in caplog.records]
    assert any(body.name in w and "xxh3_128 is" in w for w in warnings), warnings
    assert sorted(os.listdir(cluster.held_dir)) == [records[0].stem + ".body", records[0].name]
    current = follower.round
    assert isinstance(current, FollowerRound)
    assert [s.worker_id for s, _ in current.held] == ["w1"]  # w1's slice is held again
    deadline = time.monotonic() + 20
    while current.decided is None:  # the decision comes; w2's slice is missing
        assert time.monotonic() < deadline, "the decision never came"
        time.sleep(0.05)
    assert follower.version == 0 and current.waiting_for() == ["w2"]
    # w2's result poll tells it to send its slice again (it has not been lost for good)
    status, data = call(cluster.urls[1], "GET", "/v1/rounds/0/result", worker_id="w2")
    assert (status, json.loads(data)["kind"]) == (409, "not_submitted"), data


def test_a_kept_spool_file_longer_than_the_body_is_copied_to_its_size(tmp_path) -> None:
    """A spool file kept from a larger upload holds stale bytes past the body: the held copy
    is exactly the body, and reads back to the same tensors."""
    body = save({"b": torch.tensor([2.0, 4.0]), "c": torch.tensor([1.0])})
    spooled = tmp_path / "spool"
    spooled.write_bytes(body + b"\xff" * 4096)
    store = HeldSlices(tmp_path / "held")
    with open(spooled, "rb") as file:
        data_start, entries, metadata = read_frame_header(body, len(body))
        tensors = SpooledTensors(file, len(body), data_start, entries, SpoolFiles(keep=0))
        prepared = store.prepare(
            tensors, metadata, worker_id="w1", session="s", round_number=3, fragment=0,
            tokens=7, units=[1, 2], progress={5: 9},
        )  # fmt: skip
    kept = store.keep(prepared, "s2")  # re-registered meanwhile: the round notes s2
    assert kept.body.read_bytes() == body
    assert kept.digest == ("xxh3_128", xxhash.xxh3_128(body).hexdigest())
    (listed,), problems = store.stored()
    assert problems == [] and listed == kept
    assert (listed.session, listed.tokens, listed.units, listed.progress) == (
        "s2",
        7,
        [1, 2],
        {5: 9},
    )
    reopened = store.open(listed)
    values = {name: piece.clone() for name, _, piece in reopened.pieces()}
    reopened.close()
    assert torch.equal(values["b"], torch.tensor([2.0, 4.0]))
    assert torch.equal(values["c"], torch.tensor([1.0]))
    store.forget_before(3)
    assert store.stored()[0] == [listed]
    store.forget_before(4)
    assert os.listdir(tmp_path / "held") == []


def test_an_async_follower_applies_a_decided_arrival_from_the_slice_it_held(
    async_cluster,
) -> None:
    """Async: w1's arrival (anchor 0) is version 1 on shard 0; shard 1, which never learned
    it, restarts and applies it from its state dir. By hand (Delayed Nesterov, N = 1, lr 1,
    momentum 0.5, first step m = g): theta -= 0.5 m + g = 1.5 g, with g as in
    test_server_http_shard_async.py: b [4, 8], c [2] -> b [10 - 6, -10 - 12], c [0.5 - 3]."""
    url0, url1 = async_cluster.urls
    g = {"a": torch.tensor([2.0, 0.0, -2.0, 4.0]), "b": torch.tensor([4.0, 8.0]),
         "c": torch.tensor([2.0])}  # fmt: skip
    register([url0, url1], "w1")
    assert submit(url0, "w1", {"a": g["a"]})[0] == 200
    assert submit(url1, "w1", {n: g[n] for n in OWNED[1]})[0] == 200
    status, data = call(url0, "POST", "/v1/rounds/0/confirm", worker_id="w1")
    assert status == 200, data
    wait_version(async_cluster.leader, 1)
    assert async_cluster.follower.version == 0
    async_cluster.stop_follower()
    follower = async_cluster.restart_follower()
    wait_version(follower, 1)
    masters = follower.masters
    assert masters is not None
    torch.testing.assert_close(masters["b"], torch.tensor([4.0, -22.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(masters["c"], torch.tensor([-2.5]), rtol=0, atol=1e-6)


def test_at_start_a_record_that_cannot_be_read_or_a_body_of_another_size_is_dropped(
    tmp_path: Path,
) -> None:
    """What a store finds at start: kept slices are listed, the rest removed and said."""
    store = HeldSlices(tmp_path)
    bodies = [{"b": torch.tensor([float(i), 1.0])} for i in range(3)]
    kept = []
    for i, tensors in enumerate(bodies):
        prepared = store.prepare(
            tensors, None, worker_id=f"w{i}", session=None, round_number=0, fragment=0,
            tokens=0, units=[], progress={},
        )  # fmt: skip
        kept.append(store.keep(prepared, None))
    kept[1].record.write_text("{not json")
    size = kept[2].body.stat().st_size
    kept[2].body.write_bytes(kept[2].body.read_bytes() + b"\0")
    listed, problems = HeldSlices(tmp_path).stored()
    assert listed == [kept[0]]
    assert len(problems) == 2 and kept[1].record.name in problems[0]
    assert kept[2].record.name in problems[1]
    assert f"its body holds {size + 1} bytes, not {size}" in problems[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [kept[0].record.name, kept[0].body.name]
    )


def test_a_held_slice_recorded_with_sha256_is_taken_back_and_one_without_a_checksum_dropped(
    tmp_path,
) -> None:
    """Records written before XXH3-128 name the body's SHA-256: a restart takes such a slice
    back, checked with SHA-256 (hashlib's, by hand here). A record that names no checksum is
    a problem: its files go."""
    body = save({"b": torch.tensor([2.0, 4.0])})
    store = HeldSlices(tmp_path / "held")
    kept = []
    for worker in ("w1", "w2"):
        prepared = store.prepare(
            {"b": torch.tensor([2.0, 4.0])}, None, worker_id=worker, session="s",
            round_number=3, fragment=0, tokens=7, units=[1], progress={},
        )  # fmt: skip
        kept.append(store.keep(prepared, "s"))
    assert kept[0].body.read_bytes() == body
    old, bare = (json.loads(k.record.read_text()) for k in kept)
    del old["xxh3_128"], bare["xxh3_128"]
    old["sha256"] = hashlib.sha256(body).hexdigest()
    kept[0].record.write_text(json.dumps(old))
    kept[1].record.write_text(json.dumps(bare))
    restarted = HeldSlices(tmp_path / "held")
    (listed,), problems = restarted.stored()
    assert listed.worker_id == "w1" and listed.digest == ("sha256", old["sha256"])
    assert len(problems) == 1 and "names no checksum (one of xxh3_128, sha256)" in problems[0]
    assert not kept[1].body.exists() and not kept[1].record.exists()
    reopened = restarted.open(listed)
    assert torch.equal(
        dict((n, p.clone()) for n, _, p in reopened.pieces())["b"], torch.tensor([2.0, 4.0])
    )
    reopened.close()
    damaged = bytearray(body)
    damaged[-1] ^= 0x40  # checked with the SHA-256 its record names, the bit is caught
    listed.body.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"its body's sha256 is .* not {old['sha256']} as written"):
        restarted.open(listed)
