"""A lone fp32 body copied around the page cache as it arrives, not after its last byte.

From DIRECT_STEP_LOG_BYTES of sums on (350M), the body of a round of one sender is copied into
the state dir for the step log around the page cache (state/step_inputs.py). The copy now
follows the upload's spool file as it is written (`SpoolFollower`): these tests drive the
follower's parts alone, then a real server over a real socket, with the threshold at 0 so a
small model takes the path: the step log holds the body byte for byte, and a body cut short
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import xxhash
from crashes import killed, on_state_dir, until

from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.server.state import journal, step_inputs
from diloco.server.state.step_inputs import InputCopy, StepInputs
from diloco.wire import WireError, encode_tensors, specs_of
from diloco.wire.format.spool import SpoolFiles, spool_body
from diloco.worker import DiLoCoClient

SETTINGS = ServerSettings(sync_every=2, min_workers=1, outer_optimizer="sgd", outer_lr=1.0)
SIZE = 4 * 1024 * 1024  # fp32 values: a 16 MB body, many chunks and two direct writes


def follower() -> tuple[object, list[int], list[bool], list[int]]:
    """A follower recording what it hears: (it, written, ended, released)."""
    written: list[int] = []
    ended: list[bool] = []
    released: list[int] = []

    class Recording:
        def written(self, nbytes: int) -> None:
            written.append(nbytes)

        def ended(self, complete: bool) -> None:
            ended.append(complete)

        def release(self) -> None:
            released.append(1)

    return Recording(), written, ended, released


async def chunks_of(body: bytes, size: int, cut: int | None = None) -> AsyncIterator[bytes]:
    end = len(body) if cut is None else cut
    for start in range(0, end, size):
        yield body[start : min(start + size, end)]


def body_of(values: torch.Tensor) -> bytes:
    return bytes(encode_tensors({"w": values}))


def test_a_spooled_body_tells_its_follower_each_chunk_and_its_end(tmp_path: Path) -> None:
    body = body_of(torch.arange(100_000, dtype=torch.float32))
    it, written, ended, released = follower()
    asked: list[tuple[int, int, int]] = []

    def follow(fd: int, nbytes: int, size: int):
        asked.append((fd, nbytes, size))
        return it

    files = SpoolFiles(str(tmp_path))
    spooled = asyncio.run(
        spool_body(chunks_of(body, 65536), len(body), 1 << 30, files=files, follow=follow)
    )
    # once, with the spool file and the data's bytes (100,000 fp32 values) and the body's
    assert asked == [(spooled.file.fileno(), 400_000, len(body))]
    # after the header's chunk, every chunk, flushed: the file holds what was said
    assert written == sorted(written) and written[-1] == len(body) and len(written) >= 6
    assert ended == [True] and spooled.follower is it and released == []
    spooled.close()
    assert released == [1]  # before its file went back


def test_a_body_cut_short_ends_its_follower_incomplete_and_releases_it(tmp_path: Path) -> None:
    body = body_of(torch.arange(100_000, dtype=torch.float32))
    it, written, ended, released = follower()
    files = SpoolFiles(str(tmp_path))
    with pytest.raises(WireError, match="ended after 200000 of"):
        asyncio.run(
            spool_body(
                chunks_of(body, 50_000, cut=200_000),
                len(body),
                1 << 30,
                files=files,
                follow=lambda fd, nbytes, size: it,
            )
        )
    assert written[-1] == 200_000 and ended == [False] and released == [1]
    # no follower is asked for where the header never arrives whole
    asked = []
    with pytest.raises(WireError):
        asyncio.run(
            spool_body(
                chunks_of(body, 4, cut=4), len(body), 1 << 30, files=files,
                follow=lambda fd, nbytes, size: asked.append(1),
            )
        )  # fmt: skip
    assert asked == []


@contextmanager
def followed(tmp_path: Path, size: int, written: bytes = b"") -> Iterator[tuple[InputCopy, int]]:
    """A copy of `size` bytes following a spool file that holds `written` so far, and the
    file's descriptor (closed after)."""
    source = os.open(tmp_path / "spool", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(source, written, 0)
        copy = StepInputs(tmp_path / "inputs").follow(source, size)
        assert copy is not None
        if written:
            copy.written(len(written))
        yield copy, source
    finally:
        os.close(source)


def test_a_following_copy_keeps_behind_what_was_written(tmp_path: Path) -> None:
    """The copy waits for each 8 MiB it writes to be in the file: fed a 20 MB body a MB at a
    time from another thread, it ends with the body byte for byte and its xxh3-128."""
    data = os.urandom(20 * 1024 * 1024 + 12345)
    with followed(tmp_path, len(data)) as (copy, source):

        def arrive() -> None:
            for start in range(0, len(data), 1 << 20):
                os.pwrite(source, data[start : start + (1 << 20)], start)
                copy.written(min(start + (1 << 20), len(data)))
                time.sleep(0.005)
            copy.ended(complete=True)

        feeder = threading.Thread(target=arrive)
        feeder.start()
        size, digest = copy.durable()
        feeder.join()
        assert (size, digest) == (len(data), xxhash.xxh3_128(data).hexdigest())
        assert copy.path.read_bytes() == data


def test_a_following_copy_let_go_unfolded_stops_without_the_rest(tmp_path: Path) -> None:
    """A body that is not folded (a duplicate, a refusal) releases its copy while the copy
    waits for bytes that will come (the body is whole): it stops at once and its file goes,
    instead of writing the rest of a body nobody logs."""
    with followed(tmp_path, 20 << 20, b"x" * (9 << 20)) as (copy, _):
        releasing = threading.Thread(target=copy.release)
        releasing.start()
        releasing.join(timeout=10)
        assert not releasing.is_alive()
        assert list((tmp_path / "inputs").iterdir()) == []
        with pytest.raises(OSError, match="abandoned"):
            copy.durable()


def test_a_page_cache_copy_let_go_unfolded_skips_its_fsync_and_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's first body is copied (through the page cache) before its values are checked;
    refused while it copied, it went on to fsync and hash a file already unlinked, holding a
    copy thread and a hash thread for nothing. Now it stops after the copy's read."""
    from types import SimpleNamespace

    gate = threading.Event()
    real_copy = step_inputs.copy_prefix

    def held(source: int, target: int, size: int) -> None:
        assert gate.wait(10)
        real_copy(source, target, size)

    synced: list[int] = []
    monkeypatch.setattr(step_inputs, "copy_prefix", held)
    monkeypatch.setattr(step_inputs, "_fsync", synced.append)
    source = tmp_path / "body"
    source.write_bytes(b"y" * (1 << 20))
    with source.open("rb") as body:
        copy = StepInputs(tmp_path / "inputs").copy(SimpleNamespace(file=body, size=1 << 20))
        assert copy is not None
        copy.abandon()  # refused while its copy runs
        gate.set()
        copy.release()
    with pytest.raises(OSError, match="abandoned"):
        copy.durable()
    assert synced == [] and list((tmp_path / "inputs").iterdir()) == []


def test_a_following_copy_gives_up_when_its_upload_goes_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that ended without telling its copy (cancelled at a forced stop): the copy
    does not wait forever, so its thread and descriptor end."""
    monkeypatch.setattr(step_inputs, "FOLLOW_STALL_SECONDS", 0.2)
    with followed(tmp_path, 1 << 20) as (copy, _):
        with pytest.raises(OSError, match=r"no byte of the upload came for 0\.2 s"):
            copy.durable()
        copy.release()
        assert list((tmp_path / "inputs").iterdir()) == []


def test_a_following_copy_whose_upload_ends_short_fails_and_goes(tmp_path: Path) -> None:
    with followed(tmp_path, 20 << 20, b"x" * (9 << 20)) as (copy, _):
        copy.ended(complete=False)  # returns once the copy stopped reading
        assert copy.copied.exception() is not None
        copy.release()
        assert list((tmp_path / "inputs").iterdir()) == []
        with pytest.raises(OSError, match="ended after 9437184 bytes"):
            copy.durable()


@pytest.fixture
def direct_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every model's step log is written around the page cache (as from 1 GiB of sums), and
    the sizes of the copies that followed an upload are written down."""
    monkeypatch.setattr(journal, "DIRECT_STEP_LOG_BYTES", 0)
    followed: list[int] = []
    real = StepInputs.follow

    def spied(self: StepInputs, source: int, size: int):
        followed.append(size)
        return real(self, source, size)

    monkeypatch.setattr(StepInputs, "follow", spied)

    def no_later_copy(self: StepInputs, body, direct: bool = False):
        raise AssertionError("a followed body was copied again once whole")

    monkeypatch.setattr(StepInputs, "copy", no_later_copy)  # the follower is the copy
    return followed


def started(state: Path):
    c = on_state_dir(state, SETTINGS, checkpoint_every=10)
    initial = {"w": torch.zeros(SIZE)}
    c.register("a", specs_of(initial, {"w": "trainable"}), 1)
    c.upload_initial("a", initial)
    return c


BODY = body_of(torch.full((SIZE,), -0.5))  # its round takes w from 0 to 0 - 1.0 * (-0.5)


@contextmanager
def served(tmp_path: Path, live_server) -> Iterator[tuple[Coordinator, str]]:
    """A real server over `started`'s coordinator: (it, its URL); checks inside, as a
    graceful stop checkpoints the step and empties its log."""
    c = started(tmp_path / "state")
    try:
        with live_server(coordinator=c) as server:
            yield c, server.url
    finally:
        killed(c)


def submit_whole(url: str) -> dict:
    """BODY sent for round 0 as worker a, by a client of its own; the server's answer."""
    client = DiLoCoClient(url, read_timeout=60)
    try:
        return client.submit(0, "a", BODY)
    finally:
        client.close()


def logged_input(tmp_path: Path) -> Path:
    return tmp_path / "state" / "steps" / "gen-000000000000" / "input-0000.body"


def test_a_lone_upload_is_copied_as_it_arrives_and_logged_byte_for_byte(
    tmp_path: Path, live_server, direct_copies: list[int]
) -> None:
    with served(tmp_path, live_server) as (c, url):
        submit_whole(url)
        assert c.round_number == 1 and direct_copies == [len(BODY)]
        assert torch.equal(c.masters["w"], torch.full((SIZE,), 0.5))
        assert logged_input(tmp_path).read_bytes() == BODY
        manifest = json.loads((logged_input(tmp_path).parent / "manifest.json").read_text())
        assert manifest["files"]["input-0000.body"] == {
            "bytes": len(BODY),
            "xxh3_128": xxhash.xxh3_128(BODY).hexdigest(),
        }
        assert list((tmp_path / "state" / "inputs").iterdir()) == []


def test_an_upload_cut_short_leaves_no_copy_and_folds_nothing(
    tmp_path: Path, live_server, direct_copies: list[int]
) -> None:
    with served(tmp_path, live_server) as (c, url):
        parts = urlsplit(url)
        raw = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        raw.putrequest("POST", "/v1/rounds/0/submissions?worker_id=a")
        raw.putheader("Content-Length", str(len(BODY)))
        raw.putheader("X-Diloco-Protocol", "1")
        raw.endheaders()
        raw.send(BODY[: len(BODY) // 2])
        inputs = tmp_path / "state" / "inputs"
        assert until(lambda: any(inputs.iterdir()))  # the copy under way
        assert len(list(inputs.iterdir())) == 1
        raw.close()  # the worker dies half way
        assert until(lambda: not any(inputs.iterdir()))
        assert direct_copies == [len(BODY)]  # it was followed, then let go
        assert c.round_number == 0
        # the whole body again: folded, and logged as it came
        submit_whole(url)
        assert c.round_number == 1 and direct_copies == [len(BODY)] * 2
        assert torch.equal(c.masters["w"], torch.full((SIZE,), 0.5))  # the whole body once
        assert logged_input(tmp_path).read_bytes() == BODY


def test_a_duplicate_lets_its_copy_go_and_a_fragment_out_of_range_is_refused(
    tmp_path: Path, live_server, direct_copies: list[int]
) -> None:
    with served(tmp_path, live_server) as (c, url):
        client = DiLoCoClient(url, read_timeout=60)
        client.submit(0, "a", BODY)
        again = client.submit(0, "a", BODY)  # a retry of a committed round's body
        assert again["status"] != "accepted" and c.round_number == 1
        assert direct_copies == [len(BODY)] * 2  # followed, then let go
        assert list((tmp_path / "state" / "inputs").iterdir()) == []
        step_0 = logged_input(tmp_path).parent
        assert sorted(p.name for p in step_0.iterdir()) == ["input-0000.body", "manifest.json"]
        parts = urlsplit(url)
        raw = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        raw.request(
            "POST",
            "/v1/rounds/1/submissions?worker_id=a&fragment=5",
            body=BODY,
            headers={"X-Diloco-Protocol": "1"},
        )
        answer = raw.getresponse()
        refusal = json.loads(answer.read())
        assert answer.status == 422 and "fragment" in json.dumps(refusal), refusal
        raw.close()
        client.close()
        assert direct_copies == [len(BODY)] * 2 and c.round_number == 1


def test_only_a_server_that_logs_uploads_follows_them(tmp_path: Path) -> None:
    """Without a state dir (or sharded, or in async mode) nothing is copied, and the HTTP
    layer does not ask (no thread hop per upload)."""
    assert not Coordinator(SETTINGS, {"w": torch.zeros(2)}).copies_uploads
    windows = on_state_dir(tmp_path / "async", ServerSettings(mode="async"), checkpoint_every=10)
    assert not windows.copies_uploads  # an async window logs its sums
    killed(windows)
    c = started(tmp_path / "state")
    assert c.copies_uploads
    killed(c)
