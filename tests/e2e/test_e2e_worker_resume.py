"""A worker process killed with SIGKILL and started again on its --checkpoint-dir resumes under
the same id, with its step, optimizer and schedule, and the run finishes without an eviction."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import start_worker, wait_all

STEPS, SYNC_EVERY = 24, 4


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_a_killed_worker_resumes_from_its_checkpoint(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    server = server_process(
        "--state-dir", str(state), "--sync-every", str(SYNC_EVERY), "--min-workers", "2",
        "--heartbeat-interval", "0.3", "--heartbeat-timeout", "30",
    )  # fmt: skip
    checkpoints = tmp_path / "w1-checkpoint"
    resumable = ("--checkpoint-dir", str(checkpoints), "--max-retry-delay", "1")

    def worker(worker_id: str, shard: int, extra: tuple[str, ...] = ()):
        return start_worker(
            server.url, worker_id, shard, 2, STEPS, corpus_file, tmp_path, extra=extra
        )

    keeper = worker("w0", 0)
    victim = worker("w1", 1, resumable)
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        deadline = time.monotonic() + 120
        while client.status()["round"] < 3:
            assert time.monotonic() < deadline and victim.poll() is None
            time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert list(checkpoints.glob("gen-*")), "the worker saved its state after each round"
    # Started again with the same command line, as a user (or a supervisor) would.
    (tmp_path / "again").mkdir()
    again = start_worker(
        server.url, "w1", 1, 2, STEPS, corpus_file, tmp_path / "again", extra=resumable
    )
    wait_all([keeper, again], timeout=300)
    assert keeper.returncode == 0, (tmp_path / "w0.log").read_text()
    assert again.returncode == 0, (tmp_path / "again" / "w1.log").read_text()
    report = json.loads((tmp_path / "again" / "w1.json").read_text())
    assert report["worker_id"] == "w1"
    assert report["resumed_at_step"] >= 2 * SYNC_EVERY  # at least rounds 0 and 1 were kept
    assert report["resumed_at_step"] % SYNC_EVERY == 0  # saved at round boundaries
    assert "resumes at local step" in (tmp_path / "again" / "w1.log").read_text()
    with sqlite3.connect(state / "state.sqlite") as db:
        events = [e for (e,) in db.execute("SELECT event FROM audit")]
        contributors = [json.loads(c) for (c,) in db.execute("SELECT contributors FROM rounds")]
    assert "evicted" not in events  # back within the heartbeat timeout, under the same id
    assert len(contributors) >= STEPS // SYNC_EVERY
    assert all(c == ["w0", "w1"] for c in contributors)
