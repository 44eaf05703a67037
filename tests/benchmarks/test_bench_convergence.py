"""The convergence benchmark script stays runnable: a seconds-long variant of the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence.py"


def test_reduced_convergence_benchmark_writes_table_json_and_plot(
    tmp_path: Path, corpus_file: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--steps",
            "12",
            "--sync-every",
            "3,6",
            "--width",
            "32",
            "--depth",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--corpus",
            str(corpus_file),
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "convergence.json").read_text())
    runs = document["runs"]
    assert [r["mode"] for r in runs] == ["ddp", "single", "diloco", "diloco"]
    assert [r["sync_every"] for r in runs[2:]] == [3, 6]
    assert all(r["steps"] == 12 for r in runs)
    assert runs[1]["workers"] == 1 and runs[1]["bytes_sent_per_worker"] == 0
    ddp_bytes = runs[0]["bytes_sent_per_worker"]
    # K = 4: ddp moves 1.5 models per step, DiLoCo one model per H steps.
    assert ddp_bytes / runs[2]["bytes_sent_per_worker"] == 1.5 * 3
    assert ddp_bytes / runs[3]["bytes_sent_per_worker"] == 1.5 * 6
    table = (tmp_path / "convergence.md").read_text()
    assert table.count("\n| diloco (K=4) |") == 2 and "\n| ddp (K=4) |" in table
    assert "\n| single (K=1) |" in table and "no traffic" in table
    assert (tmp_path / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    assert "Reading (generated from the numbers above)" in table

    rerendered = tmp_path / "again"
    rerendered.mkdir()
    again = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--from-json",
            str(tmp_path / "convergence.json"),
            "--out-dir",
            str(rerendered),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert (rerendered / "convergence.md").read_text() == table


def test_missing_output_directory_is_one_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--out-dir directory does not exist" in result.stderr
