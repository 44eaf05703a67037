"""Synchronous DiLoCo as a user runs it: `diloco server` and `diloco worker` processes."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from diloco.sim import SimConfig, simulate
from diloco.worker import DiLoCoClient, RetryPolicy
from processes import global_weights, start_worker, wait_all
from tiny import TINY_MODEL


def simulated_run(corpus: bytes, workers: int, steps: int, **overrides):
    """`diloco simulate` with the settings the worker processes of these tests use."""
    settings = dict(
        mode="diloco",
        workers=workers,
        sync_every=4,
        steps=steps,
        batch_size=4,
        seq_len=32,
        model=TINY_MODEL,
        warmup=2,
        seed=5,
    )
    return simulate(SimConfig(**{**settings, **overrides}), corpus=corpus)


def test_real_server_and_two_workers_match_the_simulator(
    server_process, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """The guarantee that research done in the simulator carries over to the real system."""
    server = server_process("--sync-every", "4", "--min-workers", "2")
    workers = [start_worker(server.url, f"w{i}", i, 2, 10, corpus_file, tmp_path) for i in range(2)]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    real, round_number = global_weights(server.url)
    assert round_number == 3  # rounds end at steps 4, 8 and the partial round at 10

    simulated = simulated_run(small_corpus, workers=2, steps=10)
    assert simulated.outer_steps == 3
    assert real.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert [r["rounds"] for r in reports] == [3, 3]
    assert reports[0]["final_eval_loss"] == pytest.approx(simulated.final_eval_loss, rel=1e-5)
    for report in reports:
        assert report["bytes_sent"] > 0 and report["bytes_received"] > 0
        assert report["blocked_seconds"] >= 0


def contributed(status: dict, worker_id: str) -> int:
    """How many rounds the worker's pseudo-gradients went into (0 before it registers)."""
    counts = {w["worker_id"]: w["rounds_contributed"] for w in status["workers"]}
    return counts.get(worker_id, 0)


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_survivor_continues_after_a_worker_is_killed(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process(
        "--sync-every",
        "4",
        "--min-workers",
        "1",
        "--heartbeat-interval",
        "0.5",
        "--heartbeat-timeout",
        "3",
    )
    client = DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10)
    deadline = time.monotonic() + 120
    # The victim first, so that the keeper cannot finish its 40 steps alone while the other is
    # still starting (with --min-workers 1 each commits rounds on its own until both are in).
    victim = start_worker(server.url, "victim", 1, 2, 4000, corpus_file, tmp_path)
    while contributed(client.status(), "victim") < 1:
        assert time.monotonic() < deadline, "the victim made no progress"
        assert victim.poll() is None, (tmp_path / "victim.log").read_text()
        time.sleep(0.1)
    survivor = start_worker(server.url, "keeper", 0, 2, 40, corpus_file, tmp_path)
    while contributed(client.status(), "keeper") < 2:  # both have trained together
        assert time.monotonic() < deadline, "no progress"
        assert survivor.poll() is None and victim.poll() is None
        time.sleep(0.1)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    survivor.wait(timeout=120)
    assert survivor.returncode == 0, (tmp_path / "keeper.log").read_text()
    report = json.loads((tmp_path / "keeper.json").read_text())
    assert report["rounds"] == 10  # 40 steps / H = 4: no round was lost to the dead peer
    status = client.status()
    live = {w["worker_id"]: w["live"] for w in status["workers"]}
    assert live == {"keeper": False, "victim": False}  # keeper left cleanly, victim evicted
    assert status["round"] >= 10
    client.close()


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_kill_9_of_the_server_loses_no_round(
    server_process, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """kill -9 mid-run, restart on the same --state-dir: the worker rides through, and the
    final weights are those of an uninterrupted run (no round lost, none applied twice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    state = tmp_path / "state"
    args = ("--port", port, "--state-dir", str(state), "--sync-every", "4")
    server = server_process(*args)
    worker = start_worker(server.url, "w0", 0, 1, 40, corpus_file, tmp_path)
    client = DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10)
    deadline = time.monotonic() + 120
    while client.status()["round"] < 3:
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.02)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=10)
    client.close()
    restarted = server_process(*args)
    worker.wait(timeout=180)
    assert worker.returncode == 0, (tmp_path / "w0.log").read_text()
    real, round_number = global_weights(restarted.url)
    assert round_number == 10
    simulated = simulated_run(small_corpus, workers=1, steps=40)
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # The worker saw the outage (it retried) and rode through it without losing a round.
    assert "retrying" in (tmp_path / "w0.log").read_text()
