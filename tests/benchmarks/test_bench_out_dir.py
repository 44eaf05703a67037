"""Every benchmark refuses a missing --out-dir in one line, before it measures anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from processes import BENCHMARKS, run_benchmark_in_process

# modules that a benchmark imports (shaped_link.py also runs alone: a proxy, no results)
HELPERS = {"shaped_link.py", "wire_codecs.py"}
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if path.name not in HELPERS)


def test_every_benchmark_is_listed() -> None:
    """A new benchmark is added here on purpose, and so is known to have its checks below."""
    assert set(SCRIPTS) == {
        "codec_devices.py",
        "codecs.py",
        "compression.py",
        "convergence.py",
        "durability.py",
        "fsdp_memory.py",
        "fuzz.py",
        "model_scale.py",
        "robust_aggregation.py",
        "round_parts.py",
        "round_path.py",
        "scale.py",
        "server_threads.py",
        "simulated_modes.py",
        "slow_link.py",
        "utilization.py",
        "wire.py",
        "worker_coding.py",
    }


@pytest.mark.parametrize("script", SCRIPTS)  # in this process: no interpreter per case
def test_a_missing_out_dir_is_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    result = run_benchmark_in_process(script, "--out-dir", str(tmp_path / "absent"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "--out-dir directory does not exist" in result.stderr
