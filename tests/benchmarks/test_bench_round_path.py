"""The round-path benchmark names the files a real server runs through for one round of each
kind, and among them the function that each round kind's steps live in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark


@pytest.mark.slow  # a real server, three runs: ~7 s; its bad --out-dir is in the default suite
def test_each_round_kind_runs_through_its_own_function(tmp_path: Path) -> None:
    result = run_benchmark("round_path.py", "--out-dir", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = json.loads((tmp_path / "round_path.json").read_text())["rounds"]
    assert set(rounds) == {"sync round", "streaming fragment round", "async arrival"}
    own = {
        "sync round": ("server/rounds/barrier.py", "BarrierRounds.complete_round"),
        "streaming fragment round": ("server/rounds/barrier.py", "BarrierRounds.complete_round"),
        "async arrival": ("server/rounds/async_arrivals.py", "AsyncArrivals.complete_window"),
    }
    for kind, (path, function) in own.items():
        found = rounds[kind]
        assert function in found["functions"][path], kind
        assert "server/state/journal.py" in found["files"]  # the step is made durable
        assert not any(f.startswith("worker/") for f in found["files"])  # the client's side
        assert len(found["server_files"]) == sum(
            n for folder, n in found["by_folder"].items() if folder.startswith("server")
        )
    table = (tmp_path / "round_path.md").read_text()
    assert f"| sync round | {len(rounds['sync round']['server_files'])} |" in table
