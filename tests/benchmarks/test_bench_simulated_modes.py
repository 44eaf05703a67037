"""The simulated-modes benchmark stays runnable: a seconds-long variant of the real command."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

SMOKE = [
    "--steps", "16", "--sync-every", "8", "--width", "16", "--seq-len", "16",
    "--batch-size", "4", "--corpus", "generated",
]  # fmt: skip


def run(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("simulated_modes.py", *args, timeout=240, one_thread=True)


def refused(*args: str) -> subprocess.CompletedProcess:
    """A run that must stop before any training: in this process (no interpreter to start)."""
    return run_benchmark_in_process("simulated_modes.py", *args)


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_reduced_simulated_modes_benchmark_writes_sane_figures(tmp_path: Path) -> None:
    result = run(*SMOKE, "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "simulated_modes.json").read_text())
    runs = {r["label"]: r for r in document["runs"]}
    assert list(runs) == [
        "sync DiLoCo",
        "async DN",
        "async DN + DyLU",
        "async DyLU + grace",
        "sync DiLoCo, equal wall time",
        "ddp",
        "streaming P=2",
        "streaming P=4",
    ]
    assert all(
        math.isfinite(r["final_eval_loss"]) and r["final_eval_loss"] > 0 for r in runs.values()
    )
    assert all(r["config"]["model"]["depth"] == 4 for r in runs.values())

    # Part 1: speeds 1, 1, 0.5, 0.25; the slow workers do fewer steps in async mode.
    sync, dylu = runs["sync DiLoCo"], runs["async DN + DyLU"]
    for label in ("async DN", "async DN + DyLU"):
        steps = runs[label]["local_steps_per_worker"]
        assert steps == [16, 16, 8, 4]
        assert runs[label]["config"]["async_delay"] == 4 and runs[label]["config"]["async_c"] == 0
        assert runs[label]["simulated_wall_time"] == 16.0  # steps / max speed: the last arrival
    assert dylu["config"]["dylu"] and not runs["async DN"]["config"]["dylu"]
    # DyLU (H = 8, 8, 4, 2 at speeds 1, 1, 0.5, 0.25) makes all four arrive together at t = 8
    # and 16: the grace window makes each such group one outer step (16 arrivals without it).
    grace = runs["async DyLU + grace"]
    assert grace["config"]["grace"] == 1.0 and grace["config"]["async_delay"] == 1
    assert grace["local_steps_per_worker"] == [16, 16, 8, 4]
    assert grace["outer_steps"] == 2 and dylu["outer_steps"] == 8
    assert grace["simulated_wall_time"] == 16.0
    assert sync["local_steps_per_worker"] == [16] * 4 and sync["simulated_wall_time"] == 64.0
    equal = runs["sync DiLoCo, equal wall time"]
    assert equal["steps"] == 4 and equal["simulated_wall_time"] == dylu["simulated_wall_time"]

    # Part 2: streaming at equal inner steps; fragments cut the largest single transfer.
    ddp = runs["ddp"]
    for p in (2, 4):
        streaming = runs[f"streaming P={p}"]
        assert streaming["config"]["fragments"] == p and streaming["config"]["delay"] == 1
        assert streaming["config"]["alpha"] == 0.5
        assert streaming["peak_sync_bytes"] < sync["peak_sync_bytes"]
        assert 0 < streaming["bytes_sent_per_worker"] < ddp["bytes_sent_per_worker"]
    assert runs["streaming P=4"]["peak_sync_bytes"] < runs["streaming P=2"]["peak_sync_bytes"]

    text = (tmp_path / "simulated_modes.md").read_text()
    assert "steps / min speed = 64 units" in text and "41.13 vs 41.35" in text
    assert "\n| async DN + DyLU | 8, 8, 4, 2 | 16, 16, 8, 4 |" in text
    assert "\n| streaming P=4 | 4 |" in text and "tau = 1" in text

    rerendered = tmp_path / "again"
    rerendered.mkdir()
    again = run("--from-json", str(tmp_path / "simulated_modes.json"), "--out-dir", str(rerendered))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (rerendered / "simulated_modes.md").read_text() == text


def test_bad_settings_are_one_clear_error(tmp_path: Path) -> None:
    result = refused(*SMOKE, "--fragments", "8", "--out-dir", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "exceed --depth 4" in result.stderr
    result = refused(*SMOKE, "--sync-every", "6", "--out-dir", str(tmp_path))  # 6 % 4 != 0
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "divisible by fragments" in result.stderr
    assert not list(tmp_path.iterdir())


def test_bad_options_and_results_files_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "broken.json").write_text("{not json")
    cases = {
        ("--speeds", "1,a"): "--speeds must be comma-separated numbers",
        ("--speeds", "1,0"): "--speeds must all be finite and > 0",
        ("--from-json", str(tmp_path / "other.json")): "no ['setup', 'runs']",
        ("--from-json", str(tmp_path / "broken.json")): "is not a readable results file",
    }
    out = tmp_path / "out"
    out.mkdir()
    for args, message in cases.items():
        result = refused(*SMOKE, *args, "--out-dir", str(out))
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and message in result.stderr, args
    assert not list(out.iterdir())
