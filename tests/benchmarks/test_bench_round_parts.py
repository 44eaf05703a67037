"""The round-parts benchmark stays runnable: a small model, one run of every part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

PARTS = {
    "receive_ms",
    "send_ms",
    "spool_write_ms",
    "checked_fold_ms",
    "scan_ms",
    "fold_ms",
    "outer_step_ms",
    "memory_pass_ms",
}


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_reduced_round_parts_benchmark_times_every_part(tmp_path: Path) -> None:
    result = run_benchmark(
        "round_parts.py",
        *("--parameters", "200000", "--repeats", "1", "--out-dir", str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "round_parts.json").read_text())
    assert set(document["parts_ms"]) == PARTS
    assert all(ms > 0 for ms in document["parts_ms"].values())
    table = (tmp_path / "round_parts.md").read_text()
    assert "uvicorn: receive one body" in table and "outer step" in table


def test_bad_sizes_are_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "round_parts.py", "--repeats", "0", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--repeats >= 1" in result.stderr
