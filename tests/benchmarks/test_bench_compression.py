"""The compression benchmark stays runnable: a seconds-long variant of the real command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process

SMOKE = [
    "--steps", "8", "--sync-every", "4", "--width", "16", "--depth", "2", "--seq-len", "16",
    "--batch-size", "4", "--codecs", "fp32,int8,topk:0.03+int2", "--sweep-betas", "0,0.5,0.95",
    "--outer-variants", "sgd:1", "--downloads", "int8/int8",
]  # fmt: skip


@pytest.mark.slow  # in `make test-slow`; the benchmark is unchanged since its results were measured
def test_reduced_compression_benchmark_writes_tables_json_and_plot(
    tmp_path: Path, corpus_file: Path
) -> None:
    result = run_benchmark(
        "compression.py",
        *SMOKE,
        *("--corpus", str(corpus_file), "--out-dir", str(tmp_path)),
        timeout=240,
        one_thread=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "compression.json").read_text())
    runs = {r["label"]: r for r in document["runs"]}
    assert list(runs) == [
        "ddp",
        "fp32",
        "int8, EF 0.95",
        "int8, no EF",
        "topk:0.03+int2, EF 0.95",
        "topk:0.03+int2, no EF",
        "topk:0.03+int2, EF 0.5",
        "fp32, outer sgd lr 1",
        "topk:0.03+int2, EF 0.95, outer sgd lr 1",
        "int8, EF 0.95, down int8",
    ]
    # The sweep's beta 0 and 0.95 are the grid's runs, not trained twice.
    assert runs["topk:0.03+int2, no EF"]["parts"] == ["grid", "sweep"]
    assert runs["topk:0.03+int2, EF 0.5"]["parts"] == ["sweep"]
    assert runs["fp32, outer sgd lr 1"]["parts"] == ["outer"]
    assert all(math.isfinite(r["final_eval_loss"]) for r in runs.values())
    assert all(r["steps"] == 8 and r["workers"] == 4 for r in runs.values())
    # Two rounds of H = 4: fp32 DiLoCo sends the model twice; int8 about a quarter of that.
    fp32, int8 = runs["fp32"], runs["int8, EF 0.95"]
    assert fp32["bytes_sent_per_worker"] == 2 * 4 * fp32["parameters"]
    assert 0.25 < int8["bytes_sent_per_worker"] / fp32["bytes_sent_per_worker"] < 0.3
    assert int8["bytes_received_per_worker"] == fp32["bytes_received_per_worker"]
    assert int8["upload_codec"] == "int8" and int8["error_feedback_beta"] == 0.95
    assert runs["topk:0.03+int2, no EF"]["error_feedback_beta"] == 0
    assert runs["ddp"]["bytes_sent_per_worker"] == 8 * 2 * 3 / 4 * 4 * fp32["parameters"]
    # Every tensor of the GPT is trainable: its int8 delta down is the size of its int8 upload.
    down = runs["int8, EF 0.95, down int8"]
    assert down["parts"] == ["download"]
    assert down["bytes_received_per_worker"] == down["bytes_sent_per_worker"]
    assert down["bytes_sent_per_worker"] == int8["bytes_sent_per_worker"]

    table = (tmp_path / "compression.md").read_text()
    assert "## Targets (issue 12)" in table
    assert "- int8 + EF 0.95: eval loss" in table and "- topk:0.03+int2 + EF 0.95:" in table
    for title in (
        "## 1. upload codecs",
        "## 2. error-feedback beta",
        "## 3. outer optimizer",
        "## 4. delta downloads",
    ):
        assert title in table
    assert table.count("\n| topk:0.03+int2, EF 0.95 |") == 2  # grid and sweep
    assert "Reading (generated from the numbers above)" in table
    assert "- int8, EF 0.95, down int8: " in table and "with full fp32 downloads" in table
    assert (tmp_path / "compression.png").read_bytes()[:4] == b"\x89PNG"

    again = tmp_path / "again"
    again.mkdir()
    rendered = run_benchmark(
        "compression.py",
        *("--from-json", str(tmp_path / "compression.json"), "--out-dir", str(again)),
    )
    assert rendered.returncode == 0, rendered.stderr
    assert (again / "compression.md").read_text() == table


def test_a_bad_codec_is_one_line_before_any_training(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "compression.py", "--codecs", "int3", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "unknown codec 'int3'" in result.stderr
    assert not (tmp_path / "compression.json").exists()


def test_a_download_item_without_a_pair_is_one_line(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "compression.py", "--downloads", "int8", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--downloads takes UPLOAD/DOWNLOAD codec pairs, got 'int8'" in result.stderr
