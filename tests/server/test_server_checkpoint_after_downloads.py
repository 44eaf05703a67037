"""In sync mode a background checkpoint starts once the step's workers have their result.

Started at the commit it slowed those downloads about twofold at 85M on 2 cores
(server/model/downloads.py). These tests hold a download back and look at the disk: the
checkpoint is not there while the download is not done, is there once it is, and is there
at once when the next step needs it (`settle`), downloaded or not.
"""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
from crashes import killed, on_state_dir, until

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


def test_a_waiter_waits_until_each_worker_has_the_rounds_result() -> None:
    downloads = ResultDownloads()
    downloads.sent("a", 3)
    waiting(downloads.waiter(["a"], 3)).join(timeout=5)  # already sent: returns at once
    thread = waiting(downloads.waiter(["a", "b"], 4))
    downloads.sent("a", 4)
    downloads.sent("b", 3)  # an older result does not count
    downloads.sent("c", 4)  # nor does another worker's
    time.sleep(0.2)
    assert thread.is_alive()
    downloads.sent("b", 5)  # a newer one does
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_waiter_returns_when_told_to_go_or_at_its_longest_wait() -> None:
    downloads = ResultDownloads(max_wait=60)
    go = threading.Event()
    thread = waiting(downloads.waiter(["a"], 1), go)  # "a" never fetches
    time.sleep(0.2)
    assert thread.is_alive()
    go.set()
    downloads.wake()
    thread.join(timeout=5)
    assert not thread.is_alive()
    short = ResultDownloads(max_wait=0.3)
    began = time.monotonic()
    waiting(short.waiter(["a"], 1)).join(timeout=5)
    assert 0.3 <= time.monotonic() - began < 5


def generations(c: Coordinator) -> list[int]:
    store = c.journal.state.checkpoints
    assert store is not None
    return store.generations()


def started(state: Path, initial: dict[str, torch.Tensor]) -> Coordinator:
    """A coordinator on `state` that checkpoints every round in the background, with `a`
    registered and `initial` its round 0 (checkpoint generation 0, written at once)."""
    c = on_state_dir(state, SETTINGS, checkpoint_every=1)
    c.register("a", specs_of(initial, {name: "trainable" for name in initial}), 1)
    c.upload_initial("a", initial)
    assert generations(c) == [0]
    return c


def test_the_checkpoint_waits_until_the_steps_worker_has_its_result(tmp_path: Path) -> None:
    c = started(tmp_path / "state", {"w": torch.zeros(3)})
    c.submit("a", 0, {"w": torch.full((3,), -1.0)})  # round 0 commits: "a" has not fetched
    assert c.round_number == 1
    time.sleep(0.5)
    assert generations(c) == [0]  # round 1's checkpoint waits
    c.result_downloads.sent("a", 1)
    assert until(lambda: generations(c) == [0, 1])
    # the next step needs the checkpoint: it goes at once, fetched or not
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
    """The step's worker reads a megabyte of its 32 MB result and stalls (the rest cannot
    fit in loopback's buffers): no checkpoint; an observer's whole download (no worker) does
    not count; once the worker reads the rest, the checkpoint is written."""
    c = started(tmp_path / "state", {"w": torch.zeros(SIZE)})
    c.result_downloads.max_wait = 60
    with live_server(coordinator=c) as server:
        client = DiLoCoClient(server.url, read_timeout=60)
        client.submit(0, "a", bytes(encode_tensors({"w": torch.full((SIZE,), -1.0)})))
        parts = urlsplit(server.url)
        worker = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        worker.request("GET", "/v1/rounds/0/result?worker_id=a&wait=30")
        answer = worker.getresponse()
        assert answer.status == 200 and answer.getheader("X-Diloco-Round") == "1"
        head = answer.read(1 << 20)  # then stalls: the rest waits in the server
        observer = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        observer.request("GET", "/v1/rounds/0/result?wait=0")  # no worker: read whole
        seen = observer.getresponse()
        assert seen.status == 200 and len(seen.read()) == int(answer.getheader("Content-Length"))
        observer.close()
        time.sleep(0.5)
        assert generations(c) == [0]
        received = decode_tensors(head + answer.read())
        assert torch.equal(received["w"], torch.ones(SIZE))
        assert until(lambda: generations(c) == [0, 1])
        worker.close()
        client.close()
    killed(c)


def test_in_streaming_mode_the_checkpoint_does_not_wait_for_downloads(tmp_path: Path) -> None:
    """A fragment's result goes to whoever long-polls that fragment, at any time: the
    checkpoint starts at its commit, as before."""
    settings = ServerSettings(
        mode="streaming", sync_every=4, fragments=2, delay=1, min_workers=1, outer_lr=1.0
    )
    initial = {"blocks.0.w": torch.zeros(3), "blocks.1.w": torch.zeros(3)}
    c = on_state_dir(tmp_path / "state", settings, checkpoint_every=1)
    c.register("a", specs_of(initial, {name: "trainable" for name in initial}), 1)
    c.upload_initial("a", initial)
    c.result_downloads.max_wait = 60
    c.submit("a", 0, {"blocks.0.w": torch.full((3,), -1.0)}, fragment=0)  # never fetched
    assert until(lambda: generations(c) == [0, 1])
    killed(c)
