"""The slow-link proxy: bytes pass intact and in order, never faster than the link's rate and
never sooner than its delay; bad shapes are refused in one line."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from processes import load_benchmark, run_benchmark, run_benchmark_in_process


def shaped_link() -> ModuleType:
    return load_benchmark("shaped_link.py")


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@contextmanager
def echo_server() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()


def echo_through(port: int, payload: bytes) -> tuple[bytes, float]:
    """Send `payload` and read it back through the proxy; (what came back, seconds)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        received = bytearray()
        while len(received) < len(payload):
            chunk = conn.recv(1 << 20)
            assert chunk, "the proxy closed the connection early"
            received += chunk
        sender.join()
    return bytes(received), time.monotonic() - started


def test_a_line_sends_chunks_one_after_another_and_delays_each_by_half_the_rtt() -> None:
    link = shaped_link()
    line = link.Line(link.LinkShape(mbps=8.0, rtt_ms=100.0))  # 1 MB/s, 50 ms each way
    # 100 kB at 1 MB/s: on the line from 0 to 0.1 s, arrives at 0.15 s
    assert line.arrival(100_000, now=0.0) == pytest.approx(0.15)
    # sent at 0.05 s while the line is still busy: waits for it, 0.1 to 0.2 s, arrives 0.25 s
    assert line.arrival(100_000, now=0.05) == pytest.approx(0.25)
    # sent once the line is idle again: no waiting
    assert line.arrival(1_000, now=1.0) == pytest.approx(1.0 + 0.001 + 0.05)
    assert line.carried == 201_000


def test_the_paper_projection_is_bytes_over_rate_plus_round_trips() -> None:
    shape = shaped_link().LinkShape(mbps=100.0, rtt_ms=50.0)
    # 100 MB at 12.5 MB/s is 8 s, plus two round trips of 50 ms
    assert shape.transfer_seconds(100e6, exchanges=2) == pytest.approx(8.1)
    assert shape.buffer_bytes() == 12.5e6 * 0.05 + (1 << 20)


def test_bytes_cross_intact_no_faster_than_the_rate_and_no_sooner_than_the_delay() -> None:
    link = shaped_link()
    shape = link.LinkShape(mbps=40.0, rtt_ms=200.0)  # 5 MB/s each way
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value, in order
    with echo_server() as target, link.LinkProxy(target, shape) as proxy:
        received, seconds = echo_through(proxy.port, payload)
        assert received == payload
        assert proxy.up.carried == proxy.down.carried == len(payload)
    # up and down are separate lines, so the echo overlaps: at least one line's time plus
    # one round trip (a lower bound: a busy machine only adds to it)
    assert seconds >= len(payload) / shape.bytes_per_second + 0.2


def test_connections_through_one_proxy_share_its_line() -> None:
    link = shaped_link()
    shape = link.LinkShape(mbps=40.0, rtt_ms=0.0)
    payload = b"x" * 500_000
    with echo_server() as target, link.LinkProxy(target, shape) as proxy:
        started = time.monotonic()
        threads = [threading.Thread(target=echo_through, args=(proxy.port, payload)) for _ in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        seconds = time.monotonic() - started
        assert proxy.connections == 2 and proxy.up.carried == 2 * len(payload)
    assert seconds >= 2 * len(payload) / shape.bytes_per_second  # one line carried both


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["127.0.0.1:1", "--mbps", "0"], "rate must be a positive number of Mbit/s, got 0"),
        (["127.0.0.1:1", "--rtt-ms", "-5"], "round-trip time must be >= 0 ms, got -5"),
        (["localhost"], "TARGET must be HOST:PORT"),
        (["127.0.0.1:99999"], "port must be in [1, 65535], got 99999"),
        (["127.0.0.1:0"], "port must be in [1, 65535], got 0"),
    ],
)
def test_a_shape_that_makes_no_sense_is_refused_in_one_line(args: list[str], says: str) -> None:
    result = run_benchmark_in_process("shaped_link.py", *args)
    assert result.returncode == 2
    assert says in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # real server and workers behind proxies: ~30 s
def test_the_slow_link_benchmark_measures_rounds_through_the_links(tmp_path: Path) -> None:
    result = run_benchmark(
        "slow_link.py",
        *("--size", "2M", "--workers", "2", "--steps", "4", "--sync-every", "2"),
        *("--codecs", "fp32,int8", "--modes", "sync", "--rtt-ms", "100"),
        *("--out-dir", str(tmp_path)),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "slow_link.json").read_text())
    fp32, int8 = document["results"]
    model_bytes = 4 * document["setup"]["parameters"]
    for run in (fp32, int8):
        assert run["rounds"] == [2, 2]
        # every byte a worker counted went through its own link, and at least one round trip
        # of 100 ms sits in each sync
        assert run["blocked_per_round"] >= 0.1
        for up, down in run["link_bytes"]:
            assert up >= 2 * run["up_bytes_per_round"] * 0.99 and down > model_bytes
    # fp32 sends the model each round; int8 a quarter of it plus a scale per 128 values
    assert fp32["up_bytes_per_round"] >= model_bytes
    assert int8["up_bytes_per_round"] < 0.3 * fp32["up_bytes_per_round"]
    assert fp32["blocked_vs_fp32"] == 1.0 and int8["blocked_vs_fp32"] is not None
    assert "| sync | int8 / int8 |" in (tmp_path / "slow_link.md").read_text()
    # the last worker in: a real split that adds up to no more than its blocked time
    for run in (fp32, int8):
        split = run["last_in_phases"]
        assert (
            0.1
            <= run["last_in_per_round"]
            <= max(
                max(w, key=lambda f: f["blocked_seconds"])["blocked_seconds"]
                for w in run["round_figures"]
            )
        )
        assert split["upload"] > 0 and sum(split.values()) <= run["last_in_per_round"] + 1e-6


def slow_link() -> ModuleType:
    shaped_link()  # slow_link imports it from benchmarks/
    return load_benchmark("slow_link.py")


def figures(step: int, blocked: float, wait: float) -> dict:
    phases = {"encode": 0.1, "upload": 0.2, "wait": wait, "download": 0.3, "apply": 0.05}
    return {"step": step, "blocked_seconds": blocked, "phases": {"blocked": blocked, **phases}}


def test_last_in_takes_each_rounds_worker_that_waited_least() -> None:
    """Per round ended by every worker (matched by step, the first left out), the figures of
    the worker with the shortest wait; a round only one worker ended is not compared."""
    a = [figures(2, 9.0, 8.0), figures(4, 3.0, 2.0), figures(6, 1.0, 0.1)]
    b = [figures(2, 9.5, 8.5), figures(4, 1.5, 0.2), figures(6, 2.5, 1.6), figures(8, 0.5, 0.0)]
    blocked, split = slow_link().last_in([{"round_figures": a}, {"round_figures": b}])
    # step 4: b (wait 0.2, blocked 1.5); step 6: a (wait 0.1, blocked 1.0); step 8: b alone
    assert blocked == pytest.approx((1.5 + 1.0) / 2)
    assert split["wait"] == pytest.approx((0.2 + 0.1) / 2) and split["upload"] == 0.2
    no_split = [{"step": s, "blocked_seconds": 1.0} for s in (2, 4)]
    assert slow_link().last_in([{"round_figures": no_split}, {"round_figures": a}]) is None


def test_compare_sets_each_row_against_fp32_and_its_own_sync_run() -> None:
    """Ratios by hand: fp32's sync blocks 10 s (last in 8), int8's 4 (2), int8 streaming
    0.5 (0.4): int8 sync is 0.4x fp32's, and streaming hides 1 - 0.5 / 4 = 87.5 % of int8's
    sync time (last in 1 - 0.4 / 2 = 80 %); a row given twice is refused."""

    def row(mode: str, codec: str, blocked: float, last: float) -> dict:
        wall = blocked + 10.0
        return {"mode": mode, "codec": codec, "blocked_per_round": blocked,
                "wall_per_round": wall, "last_in_per_round": last}  # fmt: skip

    results = [row("sync", "fp32", 10.0, 8.0), row("sync", "int8", 4.0, 2.0)]
    results.append(row("streaming", "int8", 0.5, 0.4))
    slow_link().compare(results)
    sync8, streaming8 = results[1], results[2]
    assert sync8["blocked_vs_fp32"] == pytest.approx(0.4)
    assert sync8["last_in_vs_fp32"] == pytest.approx(0.25)
    assert sync8["wall_vs_fp32"] == pytest.approx(14.0 / 20.0)
    assert sync8["hidden"] is None and results[0]["hidden"] is None
    assert streaming8["hidden"] == pytest.approx(0.875)
    assert streaming8["hidden_last_in"] == pytest.approx(0.8)
    assert streaming8["blocked_vs_fp32"] is None  # no fp32 streaming row to compare with
    with pytest.raises(ValueError, match="each mode and codec must come once"):
        slow_link().compare([*results, row("sync", "int8", 3.0, 1.0)])


def test_a_streaming_run_splits_its_rounds_blocked_time_into_sends_waits_and_mixes() -> None:
    """Per worker the median over its cycles of each part (the first cycle, which waits for
    the late joiners, and the last, close()'s flush, left out), then the mean over workers;
    a sync run has no such split."""

    def cycle(send: float, wait: float, mix: float) -> dict:
        return {
            "blocked_seconds": send + wait + mix,
            "phases": {"send": send, "wait": wait, "mix": mix},
        }

    a = [
        cycle(9, 9, 9),
        cycle(0.1, 0.2, 0.03),
        cycle(0.3, 0.4, 0.01),
        cycle(0.2, 0.6, 0.02),
        cycle(5, 5, 5),
    ]
    b = [cycle(9, 9, 9), cycle(0.5, 0.0, 0.05), cycle(9, 9, 9)]
    reports = [{"mode": "streaming", "round_figures": figures} for figures in (a, b)]
    split = slow_link().streaming_split(reports)
    assert split == pytest.approx(
        {"send": (0.2 + 0.5) / 2, "wait": (0.4 + 0.0) / 2, "mix": (0.02 + 0.05) / 2}
    )
    assert slow_link().streaming_split([{"mode": "sync", "round_figures": a}]) is None


def test_a_streaming_cycle_s_last_in_is_the_worker_whose_merges_waited_least() -> None:
    """Cycles matched by step (the first and close()'s flush, at the same step as the last
    cycle, left out): per cycle the worker with the shortest merge waits, its blocked time
    and its send/wait/mix."""

    def cycle(step: int, send: float, wait: float) -> dict:
        phases = {"send": send, "wait": wait, "mix": 0.05}
        return {"step": step, "blocked_seconds": send + wait + 0.05, "phases": phases}

    a = [cycle(40, 9, 9), cycle(80, 0.1, 3.0), cycle(120, 0.2, 0.0), cycle(120, 7, 7)]
    b = [cycle(40, 9, 9), cycle(80, 0.3, 0.0), cycle(120, 0.1, 0.5), cycle(120, 8, 8)]
    reports = [{"mode": "streaming", "round_figures": figures} for figures in (a, b)]
    blocked, split = slow_link().last_in(reports)
    # step 80: b (wait 0, blocked 0.35); step 120: a (wait 0, blocked 0.25)
    assert blocked == pytest.approx((0.35 + 0.25) / 2)
    assert split == pytest.approx({"send": 0.25, "wait": 0.0, "mix": 0.05})


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--codecs", "fp16"], "--codecs must name some of fp32, int8"),
        (["--modes", "async"], "--modes must be sync and/or streaming"),
        (["--mbps", "-1"], "rate must be a positive number of Mbit/s"),
        (["--sync-every", "10", "--fragments", "4"], "streaming needs P | H"),
        (["--size", "7B"], "--size must be one of 2M, 25M"),
    ],
)
def test_the_slow_link_benchmark_refuses_a_setup_that_makes_no_sense(
    args: list[str], says: str, tmp_path: Path
) -> None:
    result = run_benchmark_in_process("slow_link.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2
    assert says in " ".join(result.stderr.split())
    assert not (tmp_path / "slow_link.json").exists()
