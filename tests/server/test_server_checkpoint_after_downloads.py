"""A background checkpoint starts once the results being sent at its commit are out.

Started at the commit it slowed those downloads about threefold at 85M on 2 cores
(server/model/downloads.py). These tests hold a download open and look at the disk: the
checkpoint is not there while the download is, is there once it is out, and is there at
once when the next step needs it (`settle`), download or not.
"""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
from crashes import on_state_dir

from diloco.server.coordinator import Coordinator
from diloco.server.model.downloads import ResultDownloads
from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.worker import DiLoCoClient

SETTINGS = ServerSettings(sync_every=1, min_workers=1, outer_optimizer="sgd", outer_lr=1.0)
SIZE = 8 * 1024 * 1024  # fp32 values: a 32 MB result, more than loopback's buffers hold


def waiting(wait, go: threading.Event | None = None) -> threading.Thread:
    """`wait(go)` on a thread of its own, started."""
    thread = threading.Thread(target=wait, args=(go or threading.Event(),), daemon=True)
    thread.start()
    return thread


def test_a_waiter_waits_for_the_requests_in_flight_when_it_was_made() -> None:
    downloads = ResultDownloads()
    waiting(downloads.waiter()).join(timeout=5)  # nothing in flight: returns at once
    first = downloads.enter()
    thread = waiting(downloads.waiter())
    later = downloads.enter()  # entered after the waiter: not waited for
    time.sleep(0.2)
    assert thread.is_alive() and downloads.in_flight() == 2
    downloads.leave(first)
    thread.join(timeout=5)
    assert not thread.is_alive()
    downloads.leave(later)
    downloads.leave(later)  # a second leave changes nothing
    assert downloads.in_flight() == 0


def test_a_waiter_returns_when_told_to_go_or_at_its_longest_wait() -> None:
    downloads = ResultDownloads(max_wait=60)
    downloads.enter()  # never leaves
    go = threading.Event()
    thread = waiting(downloads.waiter(), go)
    time.sleep(0.2)
    assert thread.is_alive()
    go.set()
    downloads.wake()
    thread.join(timeout=5)
    assert not thread.is_alive()
    short = ResultDownloads(max_wait=0.3)
    short.enter()
    began = time.monotonic()
    waiting(short.waiter()).join(timeout=5)
    assert 0.3 <= time.monotonic() - began < 5


def generations(c: Coordinator) -> list[int]:
    store = c.journal.state.checkpoints
    assert store is not None
    return store.generations()


def until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def started(state: Path, initial: dict[str, torch.Tensor]) -> Coordinator:
    """A coordinator on `state` that checkpoints every round in the background, with `a`
    registered and `initial` its round 0 (checkpoint generation 0, written at once)."""
    c = on_state_dir(state, SETTINGS, checkpoint_every=1)
    c.register("a", specs_of(initial, {name: "trainable" for name in initial}), 1)
    c.upload_initial("a", initial)
    assert generations(c) == [0]
    return c


def test_the_checkpoint_waits_for_a_download_under_way_at_its_commit(tmp_path: Path) -> None:
    c = started(tmp_path / "state", {"w": torch.zeros(3)})
    token = c.result_downloads.enter()  # a result being sent when round 0 commits
    c.submit("a", 0, {"w": torch.full((3,), -1.0)})
    assert c.round_number == 1
    time.sleep(0.5)
    assert generations(c) == [0]  # round 1's checkpoint waits
    c.result_downloads.leave(token)
    assert until(lambda: generations(c) == [0, 1])
    # the next step needs the checkpoint: it goes at once, download or not
    c.result_downloads.enter()
    c.submit("a", 1, {"w": torch.full((3,), -1.0)})
    time.sleep(0.2)
    assert generations(c) == [0, 1]
    c.journal.settle()
    assert generations(c) == [0, 1, 2]
    loaded = c.journal.state.checkpoints.load_latest()
    assert loaded is not None and torch.equal(loaded.tensors["weights"]["w"], torch.full((3,), 2.0))
    c.journal.state.close()


def test_a_stalled_result_download_holds_the_checkpoint_until_it_is_read(
    tmp_path: Path, live_server
) -> None:
    c = started(tmp_path / "state", {"w": torch.zeros(SIZE)})
    c.result_downloads.max_wait = 60
    with live_server(coordinator=c) as server:
        parts = urlsplit(server.url)
        observer = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        observer.request("GET", "/v1/rounds/0/result?wait=30")  # a long poll
        assert until(lambda: c.result_downloads.in_flight() == 1)
        client = DiLoCoClient(server.url, read_timeout=60)
        client.submit(0, "a", bytes(encode_tensors({"w": torch.full((SIZE,), -1.0)})))
        answer = observer.getresponse()
        assert answer.status == 200 and answer.getheader("X-Diloco-Round") == "1"
        head = answer.read(1 << 20)  # then stalls: the rest waits in the server
        time.sleep(0.5)
        assert c.result_downloads.in_flight() == 1 and generations(c) == [0]
        received = decode_tensors(head + answer.read())
        assert torch.equal(received["w"], torch.ones(SIZE))
        assert until(lambda: generations(c) == [0, 1])
        assert c.result_downloads.in_flight() == 0
        # an answer of "waiting" leaves too
        observer.request("GET", "/v1/rounds/1/result?wait=0")
        assert observer.getresponse().status == 202
        assert c.result_downloads.in_flight() == 0
        observer.close()
        client.close()
    c.journal.settle()
    c.journal.state.close()


def test_in_streaming_mode_the_checkpoint_does_not_wait_for_downloads(tmp_path: Path) -> None:
    """Long polls for the other fragment are in flight at every commit: they would hold each
    checkpoint until the next step needs it, on that step's path."""
    settings = ServerSettings(
        mode="streaming", sync_every=4, fragments=2, delay=1, min_workers=1, outer_lr=1.0
    )
    initial = {"blocks.0.w": torch.zeros(3), "blocks.1.w": torch.zeros(3)}
    c = on_state_dir(tmp_path / "state", settings, checkpoint_every=1)
    c.register("a", specs_of(initial, {name: "trainable" for name in initial}), 1)
    c.upload_initial("a", initial)
    c.result_downloads.enter()  # a long poll for fragment 1, never answered here
    c.submit("a", 0, {"blocks.0.w": torch.full((3,), -1.0)}, fragment=0)
    assert until(lambda: generations(c) == [0, 1])
    c.journal.settle()
    c.journal.state.close()
