"""The model-scale benchmark stays runnable: real server and worker processes, every figure it
promises, and the limits it measures; bad options are one line."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
from pathlib import Path

import pytest

from processes import BENCHMARKS, load_benchmark, run_benchmark, run_benchmark_in_process


def run(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("model_scale.py", *args, timeout=600, one_thread=True)


@pytest.mark.slow  # two real workers and a server per configuration
def test_a_reduced_run_reports_every_phase_beside_the_limits(tmp_path: Path) -> None:
    result = run(
        "--sizes", "2M", "--codecs", "fp32,int8", "--modes", "sync,streaming", "--rounds", "3",
        "--sync-every", "4", "--checkpoint-every", "2", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "model_scale.json").read_text())["results"]
    assert [(r["size"], r["codec"], r["mode"]) for r in rows] == [
        ("2M", "fp32", "sync"),
        ("2M", "fp32", "streaming"),
        ("2M", "int8", "sync"),
        ("2M", "int8", "streaming"),
    ]
    for row in rows:
        assert row["rounds"] == 3 and not row["cut_short"] and row["checkpoint_every"] == 2
        assert row["loopback_seconds"] > 0 and row["memory_pass_seconds"] > 0
        # two series of a warm-up and 5 rounds: the limit is the lower median of the five
        series = row["loopback_round_seconds"]
        assert [len(times) for times in series] == [6, 6]
        lower = min(statistics.median(t[1:]) for t in series)  # (kept to 0.1 ms)
        assert row["loopback_seconds"] == pytest.approx(lower, abs=1e-4)
        limit = row["loopback_seconds"] + row["memory_pass_seconds"]
        assert row["ratio_to_limit"] == pytest.approx(row["blocked_seconds"] / limit)
        spent = row["blocked_seconds"] + row["compute_seconds"]
        assert row["blocked_fraction"] == pytest.approx(row["blocked_seconds"] / spent)
        assert row["server_parts"]["fold"] > 0 and row["server_parts"]["checkpoint"] > 0
        # sync: the critical path's compute, from the row's own parts; streaming: none
        parts = row["critical_compute_seconds"]
        if row["mode"] == "streaming":
            assert parts is None and row["ratio_to_loopback_and_compute"] is None
        else:
            assert parts == {
                "encode": row["phases"]["encode"],
                "scan": row["server_parts"]["scan"],
                "fold": row["server_parts"]["fold"],
                "outer_step": row["server_parts"]["outer_step"],
                "delta": row["server_parts"]["delta"],
                "apply": row["phases"]["apply"],
            }
            floor = row["loopback_seconds"] + sum(parts.values())
            assert row["ratio_to_loopback_and_compute"] == pytest.approx(
                row["blocked_seconds"] / floor
            )
        assert row["server_peak_mb"] > row["model_mb"] > 0
        # the idle server holds torch and the HTTP stack (over 100 MiB), then the model's
        # buffers come on top: masters, sums and momentum, at least 3x the 2M model
        assert row["server_idle_mb"] > 100
        assert row["server_beyond_idle_mb"] >= 3 * row["model_mb"]
    for row in rows[::2]:  # sync rounds split their blocked time; streaming has no rounds
        # the first round's commit is not counted (a worker that joined late may make the
        # server commit one round more than each worker's windows)
        assert 1 <= row["server_commits_counted"] <= row["server_commits"] - 1
        assert set(row["phases"]) == {"encode", "upload", "wait", "download", "apply", "other"}
        assert all(seconds >= 0 for seconds in row["phases"].values())
        # every worker's steady rounds, and the last in: each round's least blocked worker's
        steady = row["steady_rounds"]
        assert [len(rounds) for rounds in steady] == [3 - row["warmup_rounds"]] * 2
        assert (
            min(map(min, ([r["blocked"] for r in w] for w in steady)))
            <= row["last_in_blocked_seconds"]
            <= max(map(max, ([r["blocked"] for r in w] for w in steady)))
        )
    assert rows[1]["last_in_blocked_seconds"] is None  # streaming: no rounds to match
    assert rows[1]["phases"] is None and rows[1]["fragments"] == 2  # 2M has 2 blocks
    for row in rows:  # a round's wall time; streaming splits its blocked time its own way
        assert row["round_seconds"] == pytest.approx(
            row["compute_seconds"] + row["blocked_seconds"]
        )
        if row["mode"] == "sync":
            assert row["streaming_phases"] is None
            continue
        split = row["streaming_phases"]
        assert set(split) == {"send", "wait", "mix"} and all(v >= 0 for v in split.values())
        assert split["send"] > 0  # every window codes and sends both fragments
        # medians of windows whose parts sum to at most their blocked time (a step that
        # neither sends nor merges blocks for nothing named), with 10 % for the medians
        assert sum(split.values()) <= 1.1 * max(
            r["blocked"] for worker in row["steady_rounds"] for r in worker
        )
    fp32, int8 = rows[0], rows[2]
    # fp32 moves the model's 4 bytes a parameter each way; int8 about a quarter of that
    assert fp32["bytes_up_per_round"] >= 4 * fp32["parameters"]
    assert int8["bytes_up_per_round"] < 0.4 * fp32["bytes_up_per_round"]
    assert int8["bytes_down_per_round"] < 0.4 * fp32["bytes_down_per_round"]
    # streaming sends every fragment once a round: the same bytes as a sync round, within 10 %
    assert rows[1]["bytes_up_per_round"] == pytest.approx(fp32["bytes_up_per_round"], rel=0.1)
    assert "| 2M (" in (tmp_path / "model_scale.md").read_text()


def rows_of(out: Path, *args: str) -> tuple[str, list[dict]]:
    """A 2M run at H = 2 with `args` that succeeds: its stderr and its rows."""
    result = run("--sizes", "2M", "--sync-every", "2", *args, "--out-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr, json.loads((out / "model_scale.json").read_text())["results"]


def int8_run(out: Path, *args: str) -> tuple[str, dict]:
    """One 2M int8 configuration at H = 2 with `args`: its stderr and its one row."""
    stderr, (row,) = rows_of(out, "--codecs", "int8", *args)
    return stderr, row


@pytest.mark.slow
def test_a_deadline_keeps_what_was_measured(tmp_path: Path) -> None:
    """--max-seconds stops the workers and counts the rounds they finished (30 s: under the
    slow suite's load, 12 s once ended before two workers had joined and trained a round)."""
    stderr, row = int8_run(tmp_path, "--rounds", "10000", "--max-seconds", "30")
    assert row["cut_short"] and 2 <= row["rounds"] < 10000
    assert "cut short by --max-seconds" in stderr


@pytest.mark.slow
def test_warm_up_rounds_are_run_and_not_counted(tmp_path: Path) -> None:
    """--warmup-rounds 2 of 4: the workers' figures and the server's parts are those of the
    last two rounds (the server's parts read once it had committed 2)."""
    _, row = int8_run(tmp_path, "--rounds", "4", "--warmup-rounds", "2")
    assert (row["rounds"], row["warmup_rounds"]) == (4, 2)
    # the server's parts were read once it had committed 2: those 2 are not counted
    assert 1 <= row["server_commits_counted"] <= row["server_commits"] - 2
    assert row["server_parts"]["fold"] > 0 and row["server_parts"]["commit"] > 0
    assert row["blocked_seconds"] > 0 and row["phases"]["upload"] > 0


@pytest.mark.slow
def test_durability_interval_takes_the_step_log_off_the_commit(tmp_path: Path) -> None:
    """--durability round,interval: two rows; the round's server logs each step before it
    (step_log > 0), the interval one writes nothing on the commit's path."""
    _, rows = rows_of(
        tmp_path, "--codecs", "fp32", "--rounds", "4", "--warmup-rounds", "2",
        "--durability", "round,interval",
    )  # fmt: skip
    assert [r["durability"] for r in rows] == ["round", "interval"]
    logged, unlogged = (r["server_parts"] for r in rows)
    assert logged["step_log"] > 0 and unlogged.get("step_log", 0.0) == 0.0
    assert "durability interval" in (tmp_path / "model_scale.md").read_text()


@pytest.mark.slow
def test_server_threads_are_compared_in_one_run(tmp_path: Path) -> None:
    """--server-threads auto,2: two rows, the server at the default 1 thread beside CPU
    workers, then at 2; the table names both counts, the default as auto."""
    _, rows = rows_of(tmp_path, "--codecs", "int8", "--rounds", "2", "--server-threads", "auto,2")
    assert [(r["server_threads"], r["server_threads_chosen"]) for r in rows] == [
        (1, None),
        (2, 2),
    ]
    table = (tmp_path / "model_scale.md").read_text()
    assert table.count("server 2 threads") == 1 and table.count("server 1 thread (auto)") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--sizes", "3B"], "--sizes must be from"),
        (["--codecs", "int4"], "--codecs must be from"),
        (["--modes", "streaming", "--sync-every", "6"], "divisible by the fragments (4 for 25M)"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--dtype", "fp16"], "--dtype must be fp32 or bf16"),
        (["--max-seconds", "0"], "must be positive"),
        (["--fragments", "0"], "--fragments must be >= 1"),
        (["--modes", "streaming", "--delay", "4"], "--delay below"),
        (["--anchor-devices", "gpu"], "--anchor-devices must be from"),
        (["--checkpoint-every", "server,0"], "--checkpoint-every must be 'server' or"),
        (["--rounds", "3", "--warmup-rounds", "3"], "--rounds above --warmup-rounds"),
        (["--warmup-rounds", "0"], "--warmup-rounds must be >= 1"),
        (["--durability", "round,sometimes"], "--durability must be from round, interval"),
        (["--shards", "2", "--durability", "interval"], "default checkpoints and durability"),
        (["--server-threads", "0"], "--server-threads must be 'auto' or integers >= 1"),
        (["--server-threads", "auto,many"], "got 'many'"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run_benchmark_in_process("model_scale.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def model_scale():
    return load_benchmark("model_scale.py")


def test_last_in_takes_each_rounds_worker_that_waited_least() -> None:
    """Per steady round, the blocked time of the worker with the shortest wait: the one
    whose training ended last, so its blocked time holds no wait for another's training."""
    a = {"rounds": [{"wait": 9, "blocked": 9.5}, {"wait": 0.1, "blocked": 1.0},
                    {"wait": 0.9, "blocked": 1.8}, {"wait": 0.0, "blocked": 0.5}]}  # fmt: skip
    b = {"rounds": [{"wait": 8, "blocked": 8.4}, {"wait": 0.6, "blocked": 1.4},
                    {"wait": 0.2, "blocked": 1.2}]}  # fmt: skip
    # warm-up round 0 left out; round 1: a (wait 0.1), round 2: b (wait 0.2); a's round 3 alone
    assert model_scale().last_in_blocked([a, b], warmup=1) == pytest.approx((1.0 + 1.2) / 2)
    assert model_scale().last_in_blocked([a, b], warmup=3) is None  # no round both reported
    no_waits = {"rounds": [{"blocked": 1.0}, {"blocked": 1.0}]}
    assert model_scale().last_in_blocked([no_waits, b], warmup=1) is None


def test_the_critical_path_compute_sums_the_rounds_own_parts() -> None:
    """A sync row's chain of computing stages: the worker's encode and apply (medians), the
    server's scan, fold, outer step and delta (means); its sum, and the blocked time and
    last in over loopback plus it. A streaming row has none."""
    row = {
        "mode": "sync",
        "phases": {"encode": 0.10, "upload": 0.5, "wait": 0.2, "download": 0.05,
                   "apply": 0.15, "other": 0.0},
        "server_parts": {"scan": 0.02, "fold": 0.08, "step_log": 0.3, "outer_step": 0.05,
                         "delta": 0.10, "commit": 0.2},
        "loopback_seconds": 0.5,
        "blocked_seconds": 2.0,
        "last_in_blocked_seconds": 1.5,
    }  # fmt: skip
    got = model_scale().with_critical_compute(row)
    assert got["critical_compute_seconds"] == {
        "encode": 0.10, "scan": 0.02, "fold": 0.08, "outer_step": 0.05, "delta": 0.10,
        "apply": 0.15,
    }  # fmt: skip
    # 0.10 + 0.02 + 0.08 + 0.05 + 0.10 + 0.15 = 0.50; loopback 0.5: 2.0 / 1.0 and 1.5 / 1.0
    assert got["critical_compute_total_seconds"] == pytest.approx(0.50)
    assert got["ratio_to_loopback_and_compute"] == pytest.approx(2.0)
    assert got["last_in_ratio_to_loopback_and_compute"] == pytest.approx(1.5)
    streaming = model_scale().with_critical_compute({**row, "mode": "streaming", "phases": None})
    assert streaming["critical_compute_seconds"] is None
    assert streaming["ratio_to_loopback_and_compute"] is None


def test_a_sync_row_without_a_last_in_still_makes_its_table_row() -> None:
    """A sync run whose workers share no steady round (cut short) has no last in: its
    compute cell gives the mean's ratio alone, 0.90 / (0.12 + 0.55) = 1.34x, by hand."""
    module = model_scale()
    rows = json.loads((BENCHMARKS / "results" / "model_scale.json").read_text())["results"]
    row = next(r for r in rows if r["mode"] == "sync")
    parts = {"encode": 0.1, "scan": 0.05, "fold": 0.1, "outer_step": 0.05, "delta": 0.1}
    row = {
        **row,
        "blocked_seconds": 0.90,
        "loopback_seconds": 0.12,
        "last_in_blocked_seconds": None,
        "last_in_ratio_to_limit": None,
        "phases": {**row["phases"], "encode": parts["encode"], "apply": 0.15},
        "server_parts": {**row["server_parts"], **{k: parts[k] for k in list(parts)[1:]}},
    }
    headers, (cells,) = module._table([module.with_critical_compute(row)])
    cell = cells[headers.index("critical-path compute s (ratio to loopback + it)")]
    assert cell == "0.55 (1.3x)"


def test_a_streaming_window_splits_its_blocked_time_into_sends_waits_and_mixes() -> None:
    """A streaming window sums what each part of the worker's blocked time (the streamer's
    own send, wait and mix counters) grew by in each step, so a step that merges one fragment
    and sends the next (delay 0) has each part where it belongs; the table shows send/wait/mix
    for a streaming row and encode/upload/wait/download/apply for a sync one."""
    module = model_scale()
    window = module._empty_window(True)
    counters = [
        {"send": 0.0, "wait": 0.0, "mix": 0.0},
        {"send": 0.10, "wait": 0.0, "mix": 0.0},  # fragment 0 sent
        {"send": 0.10, "wait": 0.0, "mix": 0.0},  # training on
        {"send": 0.10, "wait": 0.30, "mix": 0.02},  # fragment 0 merged
        {"send": 0.35, "wait": 0.90, "mix": 0.05},  # delay 0: 1 merged and 2 sent in one step
    ]
    for before, after in itertools.pairwise(counters):
        module._add_split(window, before, after)
    assert (window["send"], window["wait"], window["mix"]) == pytest.approx((0.35, 0.90, 0.05))
    assert module._blocked_split(object()) == {}  # a worker without a streamer
    assert module._empty_window(False) == {"compute": 0.0, "blocked": 0.0}
    rows = json.loads((BENCHMARKS / "results" / "model_scale.json").read_text())["results"]
    sync = {
        **next(r for r in rows if r["mode"] == "sync"),
        "compute_seconds": 2.5,
        "blocked_seconds": 1.25,
        "phases": {
            "encode": 0.1,
            "upload": 0.2,
            "wait": 0.3,
            "download": 0.4,
            "apply": 0.5,
            "other": 0.0,
        },
    }
    streaming = {**sync, "mode": "streaming", "fragments": 4, "delay": 1, "phases": None,
                 "streaming_phases": {"send": 0.12, "wait": 0.5, "mix": 0.04},
                 "critical_compute_total_seconds": None}  # fmt: skip
    headers, cells = module._table([sync, streaming])
    column = headers.index("encode/upload/wait/download/apply s (streaming: send/wait/mix s)")
    assert cells[0][column] == "0.10/0.20/0.30/0.40/0.50"
    assert cells[1][column] == "0.12/0.50/0.04"
    round_column = headers.index("round s (compute + blocked)")
    assert cells[0][round_column] == "3.75"  # 2.5 + 1.25
