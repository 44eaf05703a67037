"""`diloco admin` on bad input: one `error:` line and no traceback; exit 2 for input the
command can refuse before calling anyone, 1 for a server it cannot reach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_all, run_each_in_process

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.mark.parametrize(
    "part",
    [
        pytest.param("in-process", id="in-process"),  # every case, through typer's runner
        pytest.param("one-process", id="one-process"),  # a real `diloco admin` process
        pytest.param("processes", id="processes", marks=pytest.mark.slow),  # every case
    ],
)
def test_bad_admin_commands_exit_with_one_error_line(tmp_path: Path, part: str) -> None:
    missing = str(tmp_path / "missing")
    cases = {
        "zero lr": (["set-outer-lr", DOWN, "0"], 2, "LR must be a positive finite number"),
        "nan lr": (["set-outer-lr", DOWN, "nan"], 2, "LR must be a positive finite number"),
        "lr not a number": (["set-outer-lr", DOWN, "fast"], 2, "Invalid value for 'LR'"),
        "missing token file": (["pause", DOWN, "--token-file", missing], 2, "cannot be read"),
        "audit limit": (["audit", DOWN, "--limit", "0"], 2, "--limit must be between 1 and 1000"),
        "audit after": (["audit", DOWN, "--after", "-1"], 2, "--after must be >= 0"),
        "weights dir": (["weights", DOWN, f"{missing}/w.safetensors"], 2, "does not exist"),
        "not a url": (["resume", "ftp://x"], 2, "http"),
        "server down": (["pause", DOWN], 2, "no diloco server answered at http://127.0.0.1:9"),
    }
    if part == "one-process":
        cases = dict(list(cases.items())[:1])
    commands = {label: ["admin", *args] for label, (args, _, _) in cases.items()}
    in_process = part == "in-process"
    outcomes = (run_each_in_process if in_process else run_all)(commands)
    for label, (_, code, needle) in cases.items():
        returncode, _, stderr = outcomes[label]
        assert returncode == code, (label, stderr)
        assert needle in stderr and "Traceback" not in stderr, (label, stderr)


def test_admin_commands_steer_a_live_server(live_server, tmp_path: Path) -> None:
    """pause, set-outer-lr, resume and audit --json against a server (open: no token)."""
    with live_server() as server:
        url = server.url
        outcomes = run_all({"pause": ["admin", "pause", url],
                            "lr": ["admin", "set-outer-lr", url, "0.5"]})  # fmt: skip
        outcomes |= run_all({"resume": ["admin", "resume", url]})
        audit = tmp_path / "audit.json"
        outcomes |= run_all({"audit": ["admin", "audit", url, "--json", str(audit)]})
        for label, (code, _, err) in outcomes.items():
            assert code == 0, (label, err)
        assert server.coordinator.settings.outer_lr == 0.5
        assert server.coordinator.status()["paused"] is False
    events = [e["event"] for e in json.loads(audit.read_text())]
    assert sorted(events[-3:-1]) == ["outer_lr_changed", "paused"] and events[-1] == "resumed"
