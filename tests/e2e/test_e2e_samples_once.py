"""Every sample of an epoch goes into the global model exactly once, whatever the workers do:
one is killed with SIGKILL mid-run, evicted, and resumed from its --checkpoint-dir; the other
stops normally in the middle of a work unit. Each worker writes which samples each of its
submissions trained (DILOCO_TRACE_SAMPLES, written before the submission leaves); the server's
submissions table says which (worker, round) pseudo-gradients an outer step applied."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

from diloco.data import TokenWindows, generated_corpus, split_train_val
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.data.trace import TRACE_ENV_VAR
from processes import applied_samples, start_worker, wait_all
from tiny import TINY_MODEL

UNIT_SIZE = 7  # batches of 4 end inside units: parts of units are reported
SYNC_EVERY = 3


def test_every_sample_of_an_epoch_is_applied_once_under_kills_resumes_and_exits(
    server_process, tmp_path: Path
) -> None:
    corpus = tmp_path / "small.txt"
    corpus.write_bytes(generated_corpus(num_bytes=3_000, seed=3))
    windows = len(TokenWindows(split_train_val(corpus.read_bytes()).train, TINY_MODEL.context))
    state = tmp_path / "state"
    server = server_process(
        "--state-dir", str(state), "--sync-every", str(SYNC_EVERY),
        "--heartbeat-interval", "0.3", "--heartbeat-timeout", "2",
    )  # fmt: skip
    dispatch = ("--data-dispatch", "server", "--unit-size", str(UNIT_SIZE))
    resumable = ("--checkpoint-dir", str(tmp_path / "w1-state"), "--max-retry-delay", "1")

    def worker(worker_id: str, steps: int, out: Path, extra: tuple[str, ...] = ()):
        out.mkdir(exist_ok=True)
        trace = {TRACE_ENV_VAR: str(tmp_path / f"{worker_id}-{out.name}.trace")}
        return start_worker(server.url, worker_id, 0, 1, steps, corpus, out,
                            extra=(*dispatch, *extra), dispatch=None, env=trace)  # fmt: skip

    leaver = worker("w0", 23, tmp_path / "first")  # 92 samples: it stops inside a unit
    victim = worker("w1", 60, tmp_path / "first", resumable)
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        deadline = time.monotonic() + 120

        def contributed() -> int:  # rounds of w1's own (so it has saved a checkpoint)
            workers = {w["worker_id"]: w for w in client.status()["workers"]}
            return workers["w1"]["rounds_contributed"] if "w1" in workers else 0

        while contributed() < 2:
            assert time.monotonic() < deadline and victim.poll() is None
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        while any(w["worker_id"] == "w1" and w["live"] for w in client.status()["workers"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)  # evicted: its leases go back to the pool with their prefixes
    again = worker("w1", 60, tmp_path / "again", resumable)
    wait_all([leaver, again], timeout=300)
    for process, out in ((leaver, "first/w0"), (again, "again/w1")):
        assert process.returncode == 0, (tmp_path / f"{out}.log").read_text()
    assert "resumes at local step" in (tmp_path / "again" / "w1.log").read_text()

    counts = applied_samples(sorted(tmp_path.glob("*.trace")), state)
    epoch0 = {index: n for (epoch, index), n in counts.items() if epoch == 0}
    assert sorted(epoch0) == list(range(windows)), "every sample of epoch 0 was trained"
    twice = {index: n for index, n in epoch0.items() if n != 1}
    assert not twice, f"samples applied more than once: {twice}"
    with sqlite3.connect(state / "state.sqlite") as db:
        progress = db.execute("SELECT COUNT(*) FROM wu_progress").fetchone()[0]
        units = db.execute("SELECT unit_id, state FROM wu_units WHERE epoch = 0").fetchall()
    assert progress > 0, "parts of units were recorded"
    assert all(state == "completed" for _, state in units)
