"""The wire benchmark stays runnable: a small model, one and two workers, one codec pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_reduced_wire_benchmark_measures_every_path(tmp_path: Path) -> None:
    result = run_benchmark(
        "wire.py",
        *("--parameters", "200000", "--workers", "1,2", "--rounds", "2"),
        *("--codecs", "int8/int8", "--out-dir", str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "wire.json").read_text())
    assert document["model_mb"] == 0.8
    one, two = document["results"]
    assert one["gloo"] is None and two["gloo"]["median_round_seconds"] > 0
    for entry in (one, two):
        assert entry["server"]["median_round_seconds"] > 0
        assert entry["raw_tcp"]["median_round_seconds"] > 0
        assert entry["server"]["server_peak_rss_mb"] >= entry["server"]["server_idle_rss_mb"] > 0
    assert document["outer_step"]["outer_step_seconds"] > 0

    assert document["codecs"] == ["int8/int8"]
    coded_one, coded_two = document["codec_results"]
    assert [c["workers"] for c in (coded_one, coded_two)] == [1, 2]
    for coded in (coded_one, coded_two):
        assert coded["upload_codec"] == coded["download_codec"] == "int8"
        assert coded["median_round_seconds"] > 0
        assert all(seconds > 0 for seconds in coded["phase_median_seconds"].values())
        assert coded["server_commit_mean_seconds"] > 0
        # int8 with block 128: 1 byte per element and one fp32 scale per 128, both ways
        # (every round's download a delta against the anchor) plus the header: ~1/4 of fp32.
        for direction in ("up", "down"):
            sent = coded[f"{direction}_bytes_per_worker_round"]
            assert 200_000 * 1.03 < sent < 200_000 * 1.05, (direction, sent)
            assert coded[f"{direction}_body_bytes"] <= sent
        assert coded["delta_downloads"] == coded["downloads"] == 2 * coded["workers"]
        assert coded["anchors_equal_published"] is True
        assert coded["server_peak_rss_mb"] > 0
    assert coded_one["gloo_ratio"] is None and coded_two["gloo_ratio"] > 0
    # Projections onto 1000 and 100 Mbit/s (the default --links), K = 2 only (gloo needs 2):
    # the ring moves 2 (K - 1) / K of the 800,000-byte model per worker, the server's link
    # K (up + down) bytes.
    projections = document["link_projections"]
    assert [(p["link_mbit"], p["workers"]) for p in projections] == [(1000, 2), (100, 2)]
    gloo_s = document["results"][1]["gloo"]["median_round_seconds"]
    for projection in projections:
        rate = projection["link_mbit"] * 1e6 / 8
        assert projection["gloo_seconds"] == pytest.approx(gloo_s + 800_000 / rate)
        moved = 2 * (
            coded_two["up_bytes_per_worker_round"] + coded_two["down_bytes_per_worker_round"]
        )
        got = projection["pairs"]["int8/int8"]
        assert got["round_seconds"] == pytest.approx(
            coded_two["median_round_seconds"] + moved / rate
        )
        assert got["gloo_ratio"] == pytest.approx(got["round_seconds"] / projection["gloo_seconds"])
    table = (tmp_path / "wire.md").read_text()
    assert "| 1 |" in table and "| 2 |" in table and "Outer step" in table
    assert "| int8 / int8 | 2 |" in table and "Target (int8 up" in table
    assert "## Projected onto slower links" in table and "| 100 | 2 |" in table


def test_bad_worker_counts_are_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process("wire.py", "--workers", "0,2", "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--workers must be in [1, 8]" in result.stderr


def test_bad_codec_pairs_are_one_line(tmp_path: Path) -> None:
    cases = (
        (("--codecs", "int8"), "UPLOAD/DOWNLOAD pairs"),
        (("--codecs", "int8/int7"), "int7"),
        (("--links", "100,-1"), "--links takes positive speeds"),
    )
    for args, message in cases:
        result = run_benchmark_in_process("wire.py", *args, "--out-dir", str(tmp_path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert message in result.stderr
