"""The FSDP memory benchmark stays runnable: a tiny model, every wrap, figures written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process


@pytest.mark.slow  # in `make test-slow`: three worker runs (two under torchrun)
def test_reduced_fsdp_memory_benchmark_measures_every_wrap(tmp_path: Path) -> None:
    result = run_benchmark(
        "fsdp_memory.py",
        *("--width", "32", "--depth", "1", "--steps", "2", "--out-dir", str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "fsdp_memory.json").read_text())
    runs = document["runs"]
    assert [len(runs[w]["peak_rss_mb"]) for w in ("none", "ddp", "fsdp")] == [1, 2, 2]
    # the same seed and global batches: one model, whichever way the worker is made
    losses = {w: round(runs[w]["final_eval_loss"], 4) for w in runs}
    assert len(set(losses.values())) == 1, losses
    assert all(runs[w]["worker"]["rounds"] == 1 for w in runs)
    assert "| fsdp | 2 |" in (tmp_path / "fsdp_memory.md").read_text()


@pytest.mark.parametrize(("option", "value"), [("--steps", "0"), ("--width", "12")])
def test_bad_sizes_are_one_line(tmp_path: Path, option: str, value: str) -> None:
    result = run_benchmark_in_process("fsdp_memory.py", option, value, "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert option in result.stderr
