"""The model-scale benchmark stays runnable: real server and worker processes, every figure it
promises, and the limits it measures; bad options are one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from processes import run_benchmark


def run(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("model_scale.py", *args, timeout=600, one_thread=True)


@pytest.mark.slow  # two real workers and a server per configuration
def test_a_reduced_run_reports_every_phase_beside_the_limits(tmp_path: Path) -> None:
    result = run(
        "--sizes", "2M", "--codecs", "fp32,int8", "--rounds", "3", "--sync-every", "2",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "model_scale.json").read_text())["results"]
    assert [(r["size"], r["codec"], r["mode"]) for r in rows] == [
        ("2M", "fp32", "sync"),
        ("2M", "int8", "sync"),
    ]
    for row in rows:
        assert row["loopback_seconds"] > 0 and row["memory_pass_seconds"] > 0
        limit = row["loopback_seconds"] + row["memory_pass_seconds"]
        assert row["ratio_to_limit"] == pytest.approx(row["blocked_seconds"] / limit)
        assert set(row["phases"]) == {"encode", "upload", "wait", "download", "apply", "other"}
        assert all(seconds >= 0 for seconds in row["phases"].values())
        assert row["server_parts"]["fold"] > 0 and row["server_parts"]["checkpoint"] > 0
        assert row["server_peak_mb"] > row["model_mb"] > 0
    fp32, int8 = rows
    # fp32 moves the model's 4 bytes a parameter each way; int8 about a quarter of that
    assert fp32["bytes_up_per_round"] >= 4 * fp32["parameters"]
    assert int8["bytes_up_per_round"] < 0.4 * fp32["bytes_up_per_round"]
    assert int8["bytes_down_per_round"] < 0.4 * fp32["bytes_down_per_round"]
    assert "| 2M (" in (tmp_path / "model_scale.md").read_text()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--sizes", "3B"], "--sizes must be from"),
        # one process in the default suite; the rest with -m slow
        pytest.param(["--codecs", "int4"], "--codecs must be from", marks=pytest.mark.slow),
        pytest.param(
            ["--modes", "streaming", "--sync-every", "6"], "divisible by 4", marks=pytest.mark.slow
        ),
        pytest.param(["--device", "tpu"], "--device must be cpu or cuda", marks=pytest.mark.slow),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run(*args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
