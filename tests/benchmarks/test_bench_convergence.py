"""The convergence benchmark script stays runnable: a seconds-long variant of the real command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import run_benchmark, run_benchmark_in_process


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_reduced_convergence_benchmark_writes_table_json_and_plot(
    tmp_path: Path, corpus_file: Path
) -> None:
    result = run_benchmark(
        "convergence.py",
        *("--steps", "12", "--sync-every", "3,6", "--width", "32", "--depth", "2"),
        *("--outer-lr", "0.5,1.0", "--eval-every", "6", "--lr", "0.003"),
        *("--ddp-lr", "0.003,0.006", "--single-lr", "", "--diloco-lr", ""),
        *("--seq-len", "32", "--batch-size", "4", "--corpus", str(corpus_file)),
        *("--out-dir", str(tmp_path)),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "convergence.json").read_text())
    runs = document["runs"]
    assert [r["mode"] for r in runs] == ["ddp", "ddp", "single"] + ["diloco"] * 4
    assert [r["config"]["lr"] for r in runs[:3]] == [0.003, 0.006, 0.003]  # '' takes --lr's
    assert [(r["sync_every"], r["config"]["outer_lr"]) for r in runs[3:]] == [
        (3, 0.5), (3, 1.0), (6, 0.5), (6, 1.0)
    ]  # fmt: skip
    assert document["setup"]["inner_lr"] == {
        "ddp": [0.003, 0.006], "single": [0.003], "diloco": [0.003]
    }  # fmt: skip
    assert "--out-dir" not in document["setup"]["command"]
    assert all(r["steps"] == 12 for r in runs)
    assert [point[0] for point in runs[3]["eval_curve"]] == [0, 6, 12]
    assert runs[2]["workers"] == 1 and runs[2]["bytes_sent_per_worker"] == 0
    ddp_bytes = runs[0]["bytes_sent_per_worker"]
    # K = 4: ddp moves 1.5 models per step, DiLoCo one model per H steps.
    assert ddp_bytes / runs[3]["bytes_sent_per_worker"] == 1.5 * 3
    assert ddp_bytes / runs[5]["bytes_sent_per_worker"] == 1.5 * 6
    table = (tmp_path / "convergence.md").read_text()
    assert table.count("\n| diloco (K=4) |") == 4 and table.count("\n| ddp (K=4) |") == 2
    # every mode is compared with data-parallel's best run, not its first
    best_ddp = min(runs[:2], key=lambda r: r["final_eval_loss"])
    for run in runs:
        ratio = f"| {run['final_eval_loss'] / best_ddp['final_eval_loss']:.3f} |"
        assert f"{run['final_eval_loss']:.4f}" in table and ratio in table
    # One best per mode: ddp over its two lrs, DiLoCo per H over its two outer lrs
    for group in (runs[:2], runs[3:5], runs[5:7]):
        best = min(group, key=lambda r: r["final_eval_loss"])
        assert f"{best['final_eval_loss']:.4f} (best)" in table
    assert table.count("(best)") == 4  # ddp, single, H=3, H=6
    assert f"data-parallel's best: inner lr {best_ddp['config']['lr']}" in table
    edge = "smallest" if best_ddp["config"]["lr"] == 0.003 else "largest"
    assert f"ddp's best inner lr ({best_ddp['config']['lr']}) is the {edge} of its grid" in table
    assert "single's best inner lr" not in table  # a grid of one value has no edge
    assert "\n| single (K=1) |" in table and "no traffic" in table
    assert (tmp_path / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    assert "Reading (generated from the numbers above)" in table

    rerendered = tmp_path / "again"
    rerendered.mkdir()
    again = run_benchmark(
        "convergence.py",
        *("--from-json", str(tmp_path / "convergence.json"), "--out-dir", str(rerendered)),
    )
    assert again.returncode == 0, again.stderr
    assert (rerendered / "convergence.md").read_text() == table


def test_a_results_file_of_another_shape_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"runs": []}')
    result = run_benchmark_in_process(
        "convergence.py", "--from-json", str(tmp_path / "other.json"), "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "is not a results file of this benchmark: no ['setup']" in result.stderr
    assert not (tmp_path / "convergence.md").exists()
