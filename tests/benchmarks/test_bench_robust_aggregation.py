"""The robust-aggregation benchmark stays runnable: every attack under every rule, tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process


@pytest.mark.slow  # in `make test-slow`: 17 short simulated runs
def test_reduced_robust_aggregation_benchmark_runs_every_case(tmp_path: Path) -> None:
    result = run_benchmark(
        "robust_aggregation.py",
        *("--steps", "20", "--sync-every", "10", "--width", "32", "--depth", "1"),
        *("--corpus", "generated", "--jobs", "1", "--out-dir", str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "robust_aggregation.json").read_text())["runs"]
    cases = {(r["attack"], r["aggregation"]) for r in runs}
    assert len(cases) == 17
    three = [r for r in runs if r["attack"].startswith("none, K=3")]
    assert len(three) == 1 and three[0]["refused_contributions"] == 0
    by_case = {(r["attack"], r["aggregation"]): r for r in runs}
    # the 100x worker is an outlier in each of the 2 rounds under every robust rule
    assert by_case[("scale100", "median")]["refused_contributions"] == 2
    assert by_case[("scale100", "mean")]["refused_contributions"] == 0
    assert "| scale100 | median |" in (tmp_path / "robust_aggregation.md").read_text()


def test_bad_jobs_is_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "robust_aggregation.py", "--jobs", "0", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--jobs must be a positive integer" in result.stderr
