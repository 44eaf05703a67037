"""What `diloco worker` says while it runs, with its output in a file (issue 27, item 3): a
line when it joins, one per round, why a sync waits, and on SIGTERM or SIGINT a summary line
and its --json. Real `diloco server` and `diloco worker` processes on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import run_cli_in_process, start_worker
from tiny import TINY_CLI

ROUND = (
    r"round {} done at step {}: loss \d+\.\d{{4}}, \d+\.\d\d MB up, \d+\.\d\d MB down, "
    r"blocked \d+\.\d s"
)


def lines_of(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.strip()]


def assert_lines(log: Path, patterns: list[str]) -> None:
    """The log is these lines, each matching its pattern whole (numbers as \\d+)."""
    lines = lines_of(log)
    assert len(lines) == len(patterns), "\n".join(lines)
    for line, pattern in zip(lines, patterns, strict=True):
        assert re.fullmatch(pattern, line), f"{line!r} does not match {pattern!r}"


def wait_for_line(log: Path, needle: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_a_worker_logging_to_a_file_says_when_it_joins_and_each_round(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process("--sync-every", "2")
    worker = start_worker(server.url, "w0", 0, 1, 5, corpus_file, tmp_path)
    assert worker.wait(timeout=120) == 0, (tmp_path / "w0.log").read_text()
    assert_lines(
        tmp_path / "w0.log",
        [
            re.escape(f"worker w0 joined {server.url} at round 0 (sync mode, H=2)"),
            ROUND.format(0, 2),
            ROUND.format(1, 4),
            ROUND.format(2, 5),  # the last, partial round: close() syncs it
            re.escape(f"wrote {tmp_path / 'w0.json'}"),
        ],
    )
    report = json.loads((tmp_path / "w0.json").read_text())
    assert report["rounds"] == 3 and report["interrupted"] is False
    assert report["stopped_by"] is None and report["final_eval_loss"] > 0
    # --json keeps each round's figures, the same as its line says
    figures = report["round_figures"]
    assert [f["step"] for f in figures] == [2, 4, 5]
    for line, f in zip(lines_of(tmp_path / "w0.log")[1:4], figures, strict=True):
        shown = f"{f['mb_up']:.2f} MB up, {f['mb_down']:.2f} MB down, "
        assert shown + f"blocked {f['blocked_seconds']:.1f} s" in line
    assert sum(f["blocked_seconds"] for f in figures) <= report["blocked_seconds"] + 1e-9
    assert all(f["mb_up"] > 0 and f["mb_down"] > 0 for f in figures)
    # and where each round's blocked time went: its parts add up to it
    for f in figures:
        parts = f["phases"]
        assert parts["blocked"] == pytest.approx(f["blocked_seconds"])
        split = ("encode", "upload", "wait", "download", "apply", "other")
        assert sum(parts[k] for k in split) == pytest.approx(f["blocked_seconds"])
        assert parts["upload"] > 0 and parts["download"] > 0


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow),  # the same path
    ],
)
def test_a_worker_held_by_min_workers_says_why_and_a_signal_ends_it_with_a_summary(
    stop: signal.Signals, server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """Alone under --min-workers 2 its first sync waits: after DILOCO_WAIT_REPORT_SECONDS
    (30 s unless set) it says for what; a SIGTERM or SIGINT then ends it at once with a
    summary line and its --json (marked interrupted), and it leaves the run."""
    server = server_process("--sync-every", "2", "--min-workers", "2")
    log = tmp_path / "w0.log"
    # SIGINT at its default in the worker, as from a terminal: a suite run as a shell's
    # background job ignores SIGINT, and the worker rightly keeps a SIGINT it inherits ignored
    worker = start_worker(server.url, "w0", 0, 1, 1000, corpus_file, tmp_path,
                          env={"DILOCO_WAIT_REPORT_SECONDS": "1"},
                          preexec_fn=functools.partial(signal.signal, signal.SIGINT,
                                                       signal.SIG_DFL))  # fmt: skip
    wait_for_line(log, "still open")
    worker.send_signal(stop)
    try:
        code = worker.wait(timeout=30)
    except subprocess.TimeoutExpired:  # what it was doing, in its log (then the fixture ends it)
        pytest.fail(f"the worker was still running 30 s after {stop.name}:\n{log.read_text()}")
    assert code == 128 + stop, log.read_text()
    assert_lines(
        log,
        [
            re.escape(f"worker w0 joined {server.url} at round 0 (sync mode, H=2)"),
            r"WARNING diloco\.worker: round 0 still open after \d+ s, waiting for: 1 more "
            r"submission \(--min-workers\); the round commits once more workers join and submit",
            rf"worker w0 stopped by {stop.name} at step 2 of 1000: 0 rounds, \d+\.\d\d MB sent, "
            r"\d+\.\d\d MB received, \d+\.\d s blocked; it left the run",
            re.escape(f"wrote {tmp_path / 'w0.json'}"),
        ],
    )
    report = json.loads((tmp_path / "w0.json").read_text())
    assert report["interrupted"] is True and report["stopped_by"] == stop.name
    assert report["local_steps"] == 2 and report["rounds"] == 0 and report["steps"] == 1000
    assert report["final_eval_loss"] is None and report["blocked_seconds"] >= 1.0
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        assert not [w for w in client.status()["workers"] if w["live"]]


@pytest.mark.parametrize("value", ["soon", "0"])
def test_a_bad_wait_report_setting_is_one_line(
    value: str, corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_WAIT_REPORT_SECONDS", value)
    result = run_cli_in_process(
        "worker", "--server", "http://127.0.0.1:9", "--corpus", str(corpus_file), "--steps", "2",
        "--no-progress", *TINY_CLI,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    expected = {
        "soon": "DILOCO_WAIT_REPORT_SECONDS must be a number of seconds, got 'soon'",
        "0": "DILOCO_WAIT_REPORT_SECONDS must be > 0 seconds, got 0.0",
    }[value]
    assert result.stderr.strip().splitlines() == [f"error: {expected}"]


def test_a_worker_stopped_before_it_joined_says_so(corpus_file: Path, tmp_path: Path) -> None:
    """SIGTERM while it retries a server that is not there (yet): one line, exit 143."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed: nobody listens
    log = tmp_path / "w0.log"
    worker = start_worker(url, "w0", 0, 1, 2, corpus_file, tmp_path)
    wait_for_line(log, "retrying in")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()
    lines = lines_of(log)
    assert lines[-1] == f"worker stopped by SIGTERM before it joined {url}", lines
    assert all(line.startswith("WARNING diloco.worker: info: ") for line in lines[:-1]), lines
    assert not (tmp_path / "w0.json").exists()
