"""The durability benchmark stays runnable: a small model, every part of it, real files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process


def run(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("durability.py", *args, timeout=300)


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_reduced_durability_benchmark_times_every_part(tmp_path: Path) -> None:
    result = run(
        "--parameters", "100000", "--rounds", "3", "--checkpoint-every", "2",
        "--restart-sizes", "100000", "--directory", str(tmp_path), "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "durability.json").read_text())
    rounds = document["round_seconds"]
    assert set(rounds) == {"memory", "round", "interval"} and min(rounds.values()) > 0
    assert document["durability_price_round"] == rounds["round"] / rounds["memory"]
    restart = document["restart_seconds"]["100000"]
    assert 0 < restart["listening"] <= restart["first_weights"]
    # Two safetensors files of the 100k-parameter model: its data plus two small headers.
    assert 2 * 100000 * 4 < document["bytes_written"] < 2 * 100000 * 4 + 4096
    assert document["checkpoint_write_seconds"] > 0 and document["plain_write_seconds"] > 0
    text = (tmp_path / "durability.md").read_text()
    assert "--durability interval --checkpoint-every 2" in text and "first weights" in text
    assert not list(tmp_path.glob("diloco-durability-*"))  # its scratch dir is cleaned up


def test_bad_sizes_are_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "durability.py", "--restart-sizes", "25M", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2
    assert "--restart-sizes" in result.stderr and "Traceback" not in result.stderr
