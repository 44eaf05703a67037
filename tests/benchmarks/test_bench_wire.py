"""The wire benchmark stays runnable: a small model, one and two workers, one round."""

from __future__ import annotations

import json
from pathlib import Path

from processes import run_benchmark


def test_reduced_wire_benchmark_measures_every_path(tmp_path: Path) -> None:
    result = run_benchmark(
        "wire.py",
        *("--parameters", "200000", "--workers", "1,2", "--rounds", "1"),
        *("--out-dir", str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "wire.json").read_text())
    assert document["model_mb"] == 0.8
    one, two = document["results"]
    assert one["gloo"] is None and two["gloo"]["median_round_seconds"] > 0
    for entry in (one, two):
        assert entry["server"]["median_round_seconds"] > 0
        assert entry["raw_tcp"]["median_round_seconds"] > 0
        assert entry["server"]["server_peak_rss_mb"] >= entry["server"]["server_idle_rss_mb"] > 0
    assert document["outer_step"]["outer_step_seconds"] > 0
    table = (tmp_path / "wire.md").read_text()
    assert "| 1 |" in table and "| 2 |" in table and "Outer step" in table


def test_bad_worker_counts_are_one_line(tmp_path: Path) -> None:
    result = run_benchmark("wire.py", "--workers", "0,2", "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--workers must be in [1, 8]" in result.stderr
