"""The durability benchmark stays runnable: a small model, two timed rounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "durability.py"


def test_reduced_durability_benchmark_times_both_settings(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--parameters",
            "100000",
            "--rounds",
            "2",
            "--directory",
            str(tmp_path),
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "durability.json").read_text())
    assert len(document["memory_round_seconds"]) == 2
    assert len(document["durable_round_seconds"]) == 2
    assert document["plain_write_seconds"] > 0
    assert "--state-dir (durable)" in (tmp_path / "durability.md").read_text()
    assert not list(tmp_path.glob("diloco-durability-*"))  # its scratch dir is cleaned up
