"""The utilization benchmark stays runnable: real server and worker processes, a tiny model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

SMALL = [
    "--steps", "24", "--sync-every", "24", "--fragments", "4", "--width", "16",
    "--depth", "4", "--batch-size", "2",
]  # fmt: skip
MODES = ["sync", "streaming P=4 tau=1", "streaming P=4 tau=5", "async"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_benchmark("utilization.py", *args, timeout=timeout)


@pytest.mark.slow
def test_a_small_utilization_run_measures_every_mode(tmp_path: Path) -> None:
    result = run(*SMALL, "--links", "loopback", "--out-dir", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "utilization.json").read_text())
    assert document["model"] == {"width": 16, "depth": 4, "seq_len": 64, "batch_size": 2}
    results = document["results"]
    assert [r["mode"] for r in results] == MODES
    by_mode = {r["mode"]: r for r in results}
    for r in results:
        assert 0 <= r["blocked_fraction"] < 1 and r["step_seconds"] > 0
        assert r["peak_bandwidth_bytes_per_second"] > 0
    # One sync of the whole model for sync (24 steps, H = 24); streaming sends fragments, each
    # a part of the model: its largest upload is smaller.
    assert by_mode["sync"]["syncs"] == [1]
    full = by_mode["sync"]["largest_upload_bytes"]
    assert by_mode["streaming P=4 tau=1"]["largest_upload_bytes"] < full
    # The same fragment hidden behind 5 steps instead of 1 needs less bandwidth.
    tau1 = by_mode["streaming P=4 tau=1"]["peak_bandwidth_bytes_per_second"]
    tau5 = by_mode["streaming P=4 tau=5"]["peak_bandwidth_bytes_per_second"]
    assert tau5 < tau1
    table = (tmp_path / "utilization.md").read_text()
    assert "--batch-size 2" in table and all(f"| {mode} | loopback |" in table for mode in MODES)


BAD_OPTIONS = [
    (["--links", "10 Gbit/s"], "--links must name some of"),
    (["--sync-every", "20"], "H / P > 5"),
    (["--depth", "2"], "--depth >= --fragments"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--workers", "0"], "--workers and --batch-size must be >= 1"),
    (["--fragments", "0"], "--fragments 0: each must be >= 1"),
    (["--steps", "0", "--width", "-1"], "--steps 0, --width -1: each must be >= 1"),
]


@pytest.mark.parametrize(
    "args, message", BAD_OPTIONS, ids=[" ".join(args) for args, _ in BAD_OPTIONS]
)  # each refused in this process, before any work
def test_bad_options_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_benchmark_in_process("utilization.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "utilization.json").exists()
