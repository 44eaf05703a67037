"""Crash equivalence: a server killed with SIGKILL and restarted ends where an unbroken run ends.

Two `diloco worker` processes (static shards, fixed seeds) train through a `diloco server
--state-dir --checkpoint-every 2` (so a restart replays a chain of up to two steps from the
step log, and the background checkpoint of every other round is a kill point). In each case
the server dies by SIGKILL once, at a named point of the round lifecycle (the server kills
itself there: `diloco.faults`, so the crash lands exactly between the step log and the step,
or inside the checkpoint written in the background) or from outside at a moment picked by a
seeded clock; a watcher restarts it on the same port and state dir. The final global weights
must equal those of an uninterrupted run (rtol 1e-6), the rounds table must hold every round
exactly once, and the audit log must show one outer step per round: none lost, none applied
twice.

CI runs a sample of the points; `-m slow` runs them all.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco.faults import ENV_VAR
from processes import global_weights, start_worker, wait_all

STEPS, SYNC_EVERY = 24, 4
ROUNDS = STEPS // SYNC_EVERY


@dataclass(frozen=True)
class KillPoint:
    """Where the server dies: a named crash point and its n-th arrival, or an outside kill."""

    name: str
    spec: str | None = None  # DILOCO_CRASH_AT value; None: killed from outside
    after_round: int = 0  # outside kill: once the server reports this round
    delay: float = 0.0  # outside kill: then wait this long

    def __str__(self) -> str:
        return self.name


KILL_POINTS = [
    KillPoint("idle between rounds", after_round=2, delay=0.0),
    KillPoint("at a random moment", after_round=1, delay=random.Random(7).uniform(0.0, 1.5)),
    KillPoint("right after a registration", "registered:2"),
    KillPoint("while handling a heartbeat", "heartbeat:2"),
    KillPoint("mid-upload", "upload_chunk:3"),
    KillPoint("inside the barrier (one of two in)", "submission_folded:3"),
    KillPoint("barrier full, before the outer step", "submission_folded:4"),
    KillPoint("before the step log", "before_step_log:2"),
    KillPoint("step logged, nothing applied", "after_step_log:3"),
    # steps 2 and 3 only in the log (round 2's checkpoint is the newest): both replayed
    KillPoint("two steps only in the step log", "after_step_log:4"),
    KillPoint("stepped and recorded, result not yet published", "after_store_commit:4"),
    KillPoint("right after the commit", "result_published:2"),
    # the checkpoint, written in the background once the result is out: a restart replays
    # the step from its log
    KillPoint("published, before its checkpoint", "before_checkpoint:2"),
    KillPoint("during the background checkpoint write", "checkpoint_file:3"),
    KillPoint("checkpoint files written, before the rename", "checkpoint_rename:3"),
    KillPoint("checkpoint durable", "after_checkpoint:3"),
]
CI_SAMPLE = {"two steps only in the step log"}  # mid-upload and the rest: -m slow


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def server_args(
    port: str, state: Path, min_workers: int = 2, checkpoint_every: int = 2
) -> tuple[str, ...]:
    return (
        "--port",
        port,
        "--state-dir",
        str(state),
        "--sync-every",
        str(SYNC_EVERY),
        "--heartbeat-interval",
        # several heartbeats per run, so the heartbeat kill point is reached: the run trains
        # for about half a second here (0.48 s on 2026-11-29), too short for 2 at 0.3 s
        "0.1",
        "--heartbeat-timeout",
        "20",
        "--min-workers",
        str(min_workers),  # 2: every round waits for both workers, however late one starts
        "--checkpoint-every",
        str(checkpoint_every),
    )


def train_two_workers(url: str, corpus: Path, out: Path) -> list[subprocess.Popen]:
    return [
        start_worker(url, f"w{i}", i, 2, STEPS, corpus, out, extra=("--max-retry-delay", "1"))
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def unbroken_run(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path):
    """The reference: the same run with no crash."""
    from diloco.server.ops.launch import start_server, stop_process

    out = tmp_path_factory.mktemp("unbroken")
    process, url = start_server(
        out / "port", *server_args("0", out / "state"), output=(out / "server.log").open("wb")
    )
    try:
        workers = train_two_workers(url, corpus_file, out)
        wait_all(workers, timeout=300)
        for worker in workers:
            assert worker.returncode == 0, (out / "w0.log").read_text()
        weights, round_number = global_weights(url)
    finally:
        stop_process(process)
    assert round_number == ROUNDS
    return weights


def kill_from_outside(server, point: KillPoint, sig: int = signal.SIGKILL) -> None:
    from diloco.worker import DiLoCoClient, RetryPolicy

    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        deadline = time.monotonic() + 120
        while client.status()["round"] < point.after_round:
            assert time.monotonic() < deadline, "the run never reached the kill round"
            time.sleep(0.01)
    time.sleep(point.delay)
    server.process.send_signal(sig)


def run_with_one_crash(point: KillPoint, server_process, corpus: Path, tmp_path: Path):
    port, state = free_port(), tmp_path / "state"
    env = {ENV_VAR: point.spec} if point.spec else None
    first = server_process(*server_args(port, state), env=env)
    workers = train_two_workers(first.url, corpus, tmp_path)
    if point.spec is None:
        kill_from_outside(first, point)
    first.process.wait(timeout=180)
    # The crash happened (a run that never reached the point would prove nothing).
    assert first.process.returncode == -signal.SIGKILL, first.log.read_text()
    restarted = server_process(*server_args(port, state))
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    weights, round_number = global_weights(restarted.url)
    return weights, round_number, state


def check_rounds_applied_once(state: Path) -> None:
    with sqlite3.connect(state / "state.sqlite") as db:
        rounds = [r for (r,) in db.execute("SELECT round FROM rounds ORDER BY round")]
        steps = [r for (r,) in db.execute("SELECT round FROM audit WHERE event = 'outer_step'")]
        contributors = [c for (c,) in db.execute("SELECT contributors FROM rounds")]
    assert rounds == list(range(ROUNDS))
    assert sorted(steps) == list(range(ROUNDS)), "an outer step was recorded twice or never"
    assert all(c == '["w0", "w1"]' for c in contributors), contributors


def crash_case(point: KillPoint):
    marks = [] if point.name in CI_SAMPLE else [pytest.mark.slow]
    return pytest.param(point, id=point.name.replace(" ", "-"), marks=marks)


@pytest.mark.parametrize("point", [crash_case(p) for p in KILL_POINTS])
def test_a_server_killed_and_restarted_ends_like_an_unbroken_run(
    point: KillPoint, unbroken_run, server_process, corpus_file: Path, tmp_path: Path
) -> None:
    weights, round_number, state = run_with_one_crash(point, server_process, corpus_file, tmp_path)
    assert round_number == ROUNDS
    for name, expected in unbroken_run.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-6, atol=0, msg=name)
    check_rounds_applied_once(state)


def test_kill_points_cover_the_round_lifecycle() -> None:
    """At least 10 points, every named point reached by the code, the CI sample among them."""
    names = {p.name for p in KILL_POINTS}
    assert len(KILL_POINTS) >= 10 and names >= CI_SAMPLE
    source = "".join(
        path.read_text() for path in Path(__file__).parents[2].glob("src/diloco/**/*.py")
    )
    for point in KILL_POINTS:
        if point.spec:
            assert f'crash_point("{point.spec.split(":")[0]}")' in source, point.spec


def test_sigterm_flushes_and_a_restart_resumes_without_loss(
    unbroken_run, server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """With --durability interval nothing is on disk between checkpoints, except that a
    graceful stop (SIGTERM) writes the current round: the run then loses nothing at all."""
    port, state = free_port(), tmp_path / "state"
    args = (*server_args(port, state, checkpoint_every=100), "--durability", "interval")
    first = server_process(*args)
    workers = train_two_workers(first.url, corpus_file, tmp_path)
    kill_from_outside(first, KillPoint("sigterm", after_round=2), sig=signal.SIGTERM)
    assert first.process.wait(timeout=30) == 0, first.log.read_text()
    log = first.log.read_text()
    assert "checkpoint written at shutdown" in log and "Traceback" not in log
    restarted = server_process(*args)
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    weights, round_number = global_weights(restarted.url)
    assert round_number == ROUNDS
    for name, expected in unbroken_run.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-6, atol=0, msg=name)
    check_rounds_applied_once(state)


def test_interval_durability_rolls_back_to_the_last_checkpoint_and_workers_rebase(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """kill -9 between two interval checkpoints: the rounds since the last one are lost (the
    documented price), their rows are rolled back, and the workers, both ahead of the
    restarted server, rebase onto its weights and finish."""
    port, state = free_port(), tmp_path / "state"
    interval = ("--durability", "interval")
    # The server dies right after publishing its third round (version 3; the last checkpoint
    # is version 0). Until then --min-workers 2 keeps both workers in every round, so both
    # hold weights the restarted server has lost, whenever each process happened to start.
    first = server_process(
        *server_args(port, state, checkpoint_every=4),
        *interval,
        env={ENV_VAR: "result_published:3"},
    )
    workers = train_two_workers(first.url, corpus_file, tmp_path)
    first.process.wait(timeout=180)
    assert first.process.returncode == -signal.SIGKILL, first.log.read_text()
    # After the rollback one worker may rebase a window later than the other (it had not
    # received the last result when the server died) and so finish a round later: with
    # --min-workers 2 that last round would wait for a partner that has left.
    restarted = server_process(
        *server_args(port, state, min_workers=1, checkpoint_every=4),
        *interval,
        "--override-settings",
    )
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    _, final_round = global_weights(restarted.url)
    with sqlite3.connect(state / "state.sqlite") as db:
        rounds = [r for (r,) in db.execute("SELECT round FROM rounds ORDER BY round")]
        rolled_back = db.execute("SELECT detail FROM audit WHERE event = 'rolled_back'").fetchall()
    assert len(rolled_back) == 1, rolled_back
    assert json.loads(rolled_back[0][0])["rounds"] == [0, 1, 2], rolled_back
    assert rounds == list(range(final_round))  # contiguous: every kept round exactly once
    # Both workers held weights newer than the restored version 0, so each had to rebase.
    for i in range(2):
        assert json.loads((tmp_path / f"w{i}.json").read_text())["rebases"] >= 1
