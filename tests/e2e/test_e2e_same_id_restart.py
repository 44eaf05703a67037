"""A worker killed before its first checkpoint and started again at once under the same id
waits for the server to evict its dead predecessor, then joins (it used to exit on 409)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import start_worker, wait_all


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_a_same_id_restart_waits_for_the_eviction_then_trains(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process(
        "--sync-every", "4", "--heartbeat-interval", "0.3", "--heartbeat-timeout", "15",
    )  # fmt: skip
    first = start_worker(server.url, "w0", 0, 1, 400, corpus_file, tmp_path)
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        deadline = time.monotonic() + 120
        while not any(w["worker_id"] == "w0" for w in client.status()["workers"]):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    (tmp_path / "again").mkdir()
    started = time.monotonic()
    again = start_worker(server.url, "w0", 0, 1, 8, corpus_file, tmp_path / "again")
    wait_all([again], timeout=180)
    log = (tmp_path / "again" / "w0.log").read_text()
    assert again.returncode == 0, log
    assert "is held by a live worker" in log and "waiting for its eviction" in log
    # It did wait: w0 stays live for up to 15 s after its last heartbeat, longer than a worker
    # process takes to start on a loaded machine (3 s was not: the eviction came first).
    assert time.monotonic() - started >= 1.0
    report = json.loads((tmp_path / "again" / "w0.json").read_text())
    assert report["worker_id"] == "w0"
