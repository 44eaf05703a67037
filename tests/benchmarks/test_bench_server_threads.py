"""The server-threads benchmark times the server's int8 round work at each thread budget, and
its byte-for-byte check of every variant's delta can fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from processes import load_benchmark, run_benchmark_in_process


def test_every_part_is_timed_at_every_budget_and_every_delta_is_the_same(tmp_path: Path) -> None:
    result = run_benchmark_in_process(
        "server_threads.py", "--size", "2M", "--threads", "1,2", "--pool", "2,3",
        "--repeats", "1", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads((tmp_path / "server_threads.json").read_text())
    assert document["size"] == "2M" and document["parameters"] == 1_715_200  # 2 blocks, w 256
    rows = document["rows"]
    assert [(r["torch_threads"], r["python_threads"]) for r in rows] == [
        (1, 1), (2, 1), (1, 2), (1, 3)
    ]  # fmt: skip
    for row in rows[:2]:
        assert row["fold_seconds"] > 0 and row["outer_step_seconds"] > 0
    for row in rows:
        assert row["delta_seconds"] > 0 and row["memory_pass_seconds"] > 0 and row["identical"]
    assert rows[2]["fold_seconds"] is None  # the pool codes the delta only
    table = (tmp_path / "server_threads.md").read_text()
    assert "| delta over 3 Python threads (torch 1 each) | - | - |" in table
    assert "--threads 1,2 --pool '2,3'" in table


def test_a_delta_that_differs_from_one_threads_is_reported_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pooled delta comes back with one byte changed: its row says NO and the run exits 2."""
    module = load_benchmark("server_threads.py")
    pooled = module.Round.pooled_delta

    def one_byte_off(self, threads: int) -> bytearray:
        body = pooled(self, threads)
        body[-1] ^= 1
        return body

    monkeypatch.setattr(module.Round, "pooled_delta", one_byte_off)
    with pytest.raises(typer.Exit) as exited:
        module.main(size="2M", threads="1", pool="2", repeats=1, out_dir=tmp_path)
    assert exited.value.exit_code == 2
    rows = json.loads((tmp_path / "server_threads.json").read_text())["rows"]
    assert [row["identical"] for row in rows] == [True, False]
    assert "| NO |" in (tmp_path / "server_threads.md").read_text()


def test_a_torch_rows_delta_that_changes_after_the_reference_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first delta (the reference) is right, every later one a byte off: the torch row
    says NO (its check compares, it does not assume)."""
    module = load_benchmark("server_threads.py")
    delta, calls = module.Round.delta, []

    def later_ones_off(self) -> bytearray:
        body = delta(self)
        calls.append(None)
        if len(calls) > 1:
            body[-1] ^= 1
        return body

    monkeypatch.setattr(module.Round, "delta", later_ones_off)
    with pytest.raises(typer.Exit):
        module.main(size="2M", threads="1", pool="", repeats=1, out_dir=tmp_path)
    rows = json.loads((tmp_path / "server_threads.json").read_text())["rows"]
    assert [row["identical"] for row in rows] == [False]


def test_a_pool_that_skips_a_tensor_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool leaves one tensor's entry unwritten (and its P unmoved): NO, though the body
    it writes into held the right bytes before (`same` codes into a fresh body)."""
    module = load_benchmark("server_threads.py")
    write_entry, skipped = module.write_entry, []

    def skip_the_first(views, name, *args, **kwargs) -> None:
        if not skipped:
            skipped.append(name)  # the first tensor it is given, every time
        if name != skipped[0]:
            write_entry(views, name, *args, **kwargs)

    monkeypatch.setattr(module, "write_entry", skip_the_first)  # (the pool's alone)
    with pytest.raises(typer.Exit):
        module.main(size="2M", threads="1", pool="2", repeats=1, out_dir=tmp_path)
    rows = json.loads((tmp_path / "server_threads.json").read_text())["rows"]
    assert [row["identical"] for row in rows] == [True, False]


def test_the_pool_splits_tensors_into_groups_of_about_equal_size() -> None:
    module = load_benchmark("server_threads.py")
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 1}
    # largest first, each to the lightest group: a | b | c, then d to c (5), e to b (7)
    assert module.balanced_groups(sizes, 3) == [["a"], ["b", "e"], ["c", "d"]]
    assert module.balanced_groups({"a": 4}, 3) == [["a"]]  # no empty groups


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--size", "7B"], "--size must be one of"),
        (["--threads", "0"], "--threads must list integers >= 1"),
        (["--threads", ""], "--threads must list integers >= 1"),
        (["--pool", "two"], "--pool must list integers >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run_benchmark_in_process("server_threads.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("value", "args", "needle"),
    [
        ("1", ["--threads", "1,2", "--pool", ""], "give one --threads count and --pool ''"),
        ("1", ["--threads", "1", "--pool", "2"], "give one --threads count and --pool ''"),
        ("on", ["--threads", "1"], "DILOCO_FUSED_INT8 must be 1 (on) or 0 (off), got 'on'"),
    ],
)
def test_the_fused_kernels_take_one_thread_count_a_run(
    tmp_path: Path, monkeypatch, value: str, args: list[str], needle: str
) -> None:
    monkeypatch.setenv("DILOCO_FUSED_INT8", value)
    result = run_benchmark_in_process("server_threads.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
