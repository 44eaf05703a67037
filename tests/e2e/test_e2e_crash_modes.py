"""Crash equivalence in streaming and async mode: kill -9 of the server at named points of a
fragment round or an async arrival, restart on the same state dir.

Streaming: the final weights equal the simulator's (itself equal to an unbroken real run,
tests/e2e/test_e2e_streaming.py), every fragment round is applied once. Async: arrival order
depends on timing, so the check is the bookkeeping: every pseudo-gradient a worker sent was
applied exactly once (the submissions table's key, and the count against the workers' own),
and the versions are contiguous.

CI runs a sample of the points; `-m slow` runs them all.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest
import torch
from test_e2e_crash import free_port
from test_e2e_streaming import simulated_streaming
from test_e2e_sync import simulated_run

from diloco.faults import ENV_VAR
from processes import global_weights, start_worker, wait_all

STEPS = 24
STREAMING_STEPS = 14  # each fragment: 6 windows + the final flush

STREAMING_POINTS = {
    "mid-upload": "upload_chunk:3",
    "inside a fragment barrier": "submission_folded:3",
    "fragment step logged, nothing applied": "after_step_log:3",
    "during a fragment's background checkpoint": "checkpoint_file:5",
    "right after a fragment commit": "result_published:3",
}
ASYNC_POINTS = {
    "arrival folded, not applied": "submission_folded:3",
    "arrival step logged, nothing applied": "after_step_log:2",
    "during an arrival's background checkpoint": "checkpoint_file:3",
    "right after an arrival's step": "result_published:2",
}
CI_SAMPLE = {"during an arrival's background checkpoint"}


def case(name: str, spec: str):
    marks = [] if name in CI_SAMPLE else [pytest.mark.slow]
    return pytest.param(spec, id=name.replace(" ", "-"), marks=marks)


def crash_once(server_process, mode_args: tuple[str, ...], spec: str, corpus: Path, out: Path):
    """Two workers train; the server dies at `spec` once and comes back on the same dir."""
    port, state = free_port(), out / "state"
    args = (
        "--port",
        port,
        "--state-dir",
        str(state),
        "--heartbeat-interval",
        "0.3",
        "--heartbeat-timeout",
        "20",
        *mode_args,
    )
    first = server_process(*args, env={ENV_VAR: spec})
    workers = [
        start_worker(first.url, f"w{i}", i, 2, STEPS, corpus, out, extra=("--max-retry-delay", "1"))
        for i in range(2)
    ]
    first.process.wait(timeout=180)
    assert first.process.returncode == -signal.SIGKILL, first.log.read_text()
    restarted = server_process(*args)
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (out / f"w{i}.log").read_text()
    weights, version = global_weights(restarted.url)
    reports = [json.loads((out / f"w{i}.json").read_text()) for i in range(2)]
    return weights, version, state, reports


def rows(state: Path, query: str) -> list[tuple]:
    with sqlite3.connect(state / "state.sqlite") as db:
        return db.execute(query).fetchall()


@pytest.mark.parametrize("spec", [case(n, s) for n, s in STREAMING_POINTS.items()])
def test_streaming_server_killed_and_restarted_ends_like_the_simulator(
    spec: str, server_process, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    mode = ("--mode", "streaming", "--sync-every", "4", "--fragments", "2", "--delay", "1")
    weights, version, state, reports = crash_once(
        server_process, (*mode, "--alpha", "0.5", "--min-workers", "2"), spec, corpus_file, tmp_path
    )
    simulated = simulated_streaming(small_corpus, workers=2, steps=STEPS, delay=1, alpha=0.5)
    assert version == simulated.outer_steps == STREAMING_STEPS
    for name, expected in simulated.final_state.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    steps = rows(state, "SELECT round, fragment, fragment_round FROM rounds ORDER BY round")
    assert [r for r, _, _ in steps] == list(range(STREAMING_STEPS))
    per_fragment = {f: sorted(fr for _, g, fr in steps if g == f) for f in (0, 1)}
    assert per_fragment == {0: list(range(7)), 1: list(range(7))}
    used = rows(state, "SELECT worker_id, COUNT(*) FROM submissions GROUP BY worker_id")
    assert dict(used) == {"w0": STREAMING_STEPS, "w1": STREAMING_STEPS}
    assert [r["fragment_rounds"] for r in reports] == [[7, 7], [7, 7]]


@pytest.mark.parametrize("spec", [case(n, s) for n, s in ASYNC_POINTS.items()])
def test_async_server_killed_and_restarted_applies_every_arrival_once(
    spec: str, server_process, corpus_file: Path, tmp_path: Path
) -> None:
    mode = ("--mode", "async", "--sync-every", "4", "--dn-period", "2")
    _, version, state, reports = crash_once(server_process, mode, spec, corpus_file, tmp_path)
    sent = {f"w{i}": report["rounds"] for i, report in enumerate(reports)}
    assert sent == {"w0": STEPS // 4, "w1": STEPS // 4}
    steps = [r for (r,) in rows(state, "SELECT round FROM rounds ORDER BY round")]
    assert steps == list(range(version)) and version == sum(sent.values())
    applied = dict(rows(state, "SELECT worker_id, COUNT(*) FROM submissions GROUP BY worker_id"))
    assert applied == sent  # every arrival applied, none twice (the table's key forbids it)
    for report in reports:
        assert report["rebases"] == 0


@pytest.mark.slow  # in the default suite: the "duplicate" answers of
# tests/server/test_server_coordinator.py and test_server_streaming.py
@pytest.mark.parametrize("mode", ["sync", "streaming"])
@pytest.mark.parametrize("point", ["result_published:2", "step_input_durable:3"])
def test_a_server_killed_after_a_commit_keeps_the_workers_error_feedback_exact(
    mode: str, point: str, server_process, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """int8 uploads with error feedback; the server killed right after publishing a round,
    before the last sender heard its answer: that worker's retry is "duplicate" (the round
    used its body), so it keeps the residual it coded the body with, and the run ends where
    the simulator ends. (Answered "committed", as before, the worker dropped that residual
    and the run drifted from the simulator by up to 5e-5.) Two int8 bodies are half the
    sums' bytes, so each step's log holds its bodies (server/state/step_inputs.py): the
    restart folds them again; killed with a body on the disk before its step is logged,
    the open round is sent again."""
    streaming = {"mode": "streaming", "fragments": 2, "delay": 1, "alpha": 0.5}
    sim_mode = streaming if mode == "streaming" else {}
    mode_args = tuple(f"--{k}={v}" for k, v in sim_mode.items())
    options = ("--upload-codec", "int8", "--error-feedback-beta", "0.95", "--sync-every", "4",
               "--min-workers", "2", *mode_args)  # fmt: skip
    weights, _, _, _ = crash_once(server_process, options, point, corpus_file, tmp_path)
    simulated = simulated_run(
        small_corpus, workers=2, steps=STEPS, upload_codec="int8", error_feedback_beta=0.95,
        **sim_mode,
    )  # fmt: skip
    for name, expected in simulated.final_state.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)
