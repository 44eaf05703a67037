"""The codec benchmark stays runnable: a tiny tensor, one run, every codec and block size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

CODECS = ["fp32", "bf16", "int8", "int4", "int2", "topk:0.03+int2", "topk:0.01+int2"]


def test_reduced_codec_benchmark_writes_both_files(tmp_path: Path) -> None:
    result = run_benchmark(
        "codecs.py",
        "--elements",
        "50000",
        "--repeats",
        "1",
        "--out-dir",
        str(tmp_path),
        one_thread=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "codecs.json").read_text())
    assert document["elements"] == 50000 and document["threads"] == 1
    assert [entry["codec"] for entry in document["throughput"]] == CODECS
    for entry in document["throughput"]:
        for key in ("encode_gbps", "decode_gbps", "fold_gbps", "bytes_per_element"):
            assert entry[key] > 0, (entry["codec"], key)
        assert 0 <= entry["relative_rms_error"] < 1
    fp32, bf16, int8 = document["throughput"][:3]
    assert fp32["bytes_per_element"] == 4 and fp32["relative_rms_error"] == 0
    assert bf16["bytes_per_element"] == 2
    # 1 byte per value and a 4-byte scale per 128 values
    assert int8["bytes_per_element"] * 50000 == pytest.approx(50000 + 4 * 391)
    grid = {(g["codec"], g["block"]) for g in document["block_sizes"]}
    assert grid == {(c, b) for c in CODECS[2:] for b in (64, 128, 256)}
    table = (tmp_path / "codecs.md").read_text()
    assert "| topk:0.01+int2 |" in table and "## Block size" in table


def test_bad_sizes_are_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process("codecs.py", "--elements", "0", "--out-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--elements must be >= 1" in result.stderr
