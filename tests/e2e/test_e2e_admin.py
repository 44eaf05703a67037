"""`diloco admin` as an operator runs it, against a real `diloco server` process with a real
`diloco worker` process: pause holds the worker's round, the outer lr changes durably, resume
lets the run finish, the masters download as a file, the audit log lists it all, a banned
worker exits with a line that says so, and `stop` ends the server cleanly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco.wire import decode_tensors
from diloco.worker import DiLoCoClient, RetryPolicy
from processes import run_all, start_worker, wait_all

ADMIN = "admin-token-0123456789"
ENROLL = "enroll-token-0123456789"
AS_ADMIN = {"DILOCO_TOKEN": ADMIN}


def status(url: str) -> dict:
    with DiLoCoClient(url, ENROLL, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        return client.status()


def wait_for(url: str, condition, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(url)
        if condition(current):
            return current
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {current}")


def admin(*args: str, env: dict[str, str] = AS_ADMIN) -> tuple[int, str, str]:
    return run_all({"admin": ["admin", *args]}, env={"admin": env})["admin"]


def server_args(tmp_path: Path) -> tuple[str, ...]:
    """Outer SGD at lr 1, H = 2, a state dir, and the admin and enrollment tokens."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin\n{ENROLL} enroll\n")
    return ("--sync-every", "2", "--outer-optimizer", "sgd", "--outer-lr", "1.0",
            "--state-dir", str(tmp_path / "state"), "--tokens-file", str(tokens))  # fmt: skip


@pytest.mark.slow  # in `make test-slow`; the default suite has the admin routes over HTTP
# (tests/server/test_server_http_admin.py) and `diloco admin` against a live server
# (tests/cli/test_cli_admin.py)
def test_an_operator_pauses_steers_and_stops_a_live_run(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process(*server_args(tmp_path))
    url = server.url

    assert admin("pause", url)[0] == 0
    worker = start_worker(url, "w0", 0, 1, 6, corpus_file, tmp_path, env={"DILOCO_TOKEN": ENROLL})
    # The worker trains its 2 steps and submits; the round stays open while paused.
    held = wait_for(
        url,
        lambda s: s["workers"] and s["workers"][0]["step"] >= 2 and not s["waiting_for"],
        "w0's submission of round 0",
    )
    time.sleep(1.0)
    assert status(url)["round"] == held["round"] == 0 and worker.poll() is None

    code, out, err = admin("set-outer-lr", url, "0.5")
    assert code == 0 and "0.5" in out, err
    assert status(url)["outer_lr"] == 0.5
    assert admin("resume", url)[0] == 0
    wait_all([worker], timeout=120)
    assert worker.returncode == 0, (tmp_path / "w0.log").read_text()
    assert status(url)["round"] == 3

    weights_file = tmp_path / "masters.safetensors"
    summary = tmp_path / "masters.json"
    code, _, err = admin("weights", url, str(weights_file), "--json", str(summary))
    assert code == 0, err
    with DiLoCoClient(url, ENROLL, retry=RetryPolicy(attempts=3), read_timeout=30) as client:
        body, round_number = client.get_weights()  # fp32 downloads: the masters themselves
    served = decode_tensors(body)
    saved = load_file(str(weights_file))
    assert round_number == json.loads(summary.read_text())["round"] == 3
    assert saved.keys() == served.keys()
    assert all(torch.equal(saved[name], served[name]) for name in served)


@pytest.mark.slow  # in `make test-slow`
def test_an_operator_bans_a_running_worker_reads_the_audit_and_stops_the_server(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process(*server_args(tmp_path))
    url = server.url
    # The enrollment token is not an admin's: 403, exit 1, one line naming the scope.
    code, _, err = admin("set-outer-lr", url, "0.5", env={"DILOCO_TOKEN": ENROLL})
    assert code == 1 and "needs an admin token" in err and "Traceback" not in err, err
    assert admin("set-outer-lr", url, "0.5")[0] == 0

    # Evicted and banned while it runs: its next call fails, and it exits naming the ban.
    banned = start_worker(url, "w1", 0, 1, 400, corpus_file, tmp_path, env={"DILOCO_TOKEN": ENROLL})
    wait_for(url, lambda s: any(w["worker_id"] == "w1" for w in s["workers"]), "w1 to register")
    code, out, err = admin("evict", url, "w1", "--ban", "--reason", "test")
    assert code == 0 and "True" in out, err
    wait_all([banned], timeout=90)
    log = (tmp_path / "w1.log").read_text()
    assert banned.returncode == 1 and "banned by an admin" in log, log

    audit = tmp_path / "audit.json"
    assert admin("audit", url, "--json", str(audit))[0] == 0
    events = [e["event"] for e in json.loads(audit.read_text())]
    admin_events = [e for e in events if e in ("outer_lr_changed", "banned", "admin_evicted")]
    assert admin_events == ["outer_lr_changed", "banned", "admin_evicted"], events

    stopped_at = status(url)["round"]
    code, out, err = admin("stop", url)
    assert code == 0 and "stopping" in out, err
    assert server.process.wait(timeout=30) == 0

    # The same command line again: the admin's lr and the ban are still the run's.
    again = server_process(*server_args(tmp_path))
    restarted = status(again.url)
    assert (restarted["round"], restarted["outer_lr"], restarted["banned"]) == (
        stopped_at,
        0.5,
        ["w1"],
    )
