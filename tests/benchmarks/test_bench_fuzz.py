"""The fuzz benchmark stays runnable: a few requests per route against a server process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

pytest.importorskip("schemathesis")


@pytest.mark.slow  # in `make test-slow`; the default suite fuzzes in tests/server
def test_reduced_fuzz_benchmark_reaches_every_route_without_a_5xx(tmp_path: Path) -> None:
    result = run_benchmark("fuzz.py", "--examples", "20", "--derandomize", "--out-dir",
                           str(tmp_path), timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    routes = json.loads((tmp_path / "fuzz.json").read_text())["routes"]
    admin = {r for r in routes if r.split()[1].startswith(("/v1/admin", "/v1/dashboard"))}
    # 15 worker and public routes; 8 admin routes (pause, resume, outer-lr, evict, unban,
    # weights, audit, stop) and the dashboard's data
    assert (len(routes), len(admin)) == (24, 9)
    assert all(not r["failures"] for r in routes.values())
    # the registered worker is reached: some leases are granted, not only 404s
    assert routes["POST /v1/datasets/{dataset_id}/leases"]["statuses"].get("200", 0) > 0


def test_bad_examples_is_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process("fuzz.py", "--examples", "0", "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--examples must be at least 1" in result.stderr
