"""Streaming mode across sharded servers, as a user runs it, and under SIGKILL.

Each shard owns whole fragments of the model's plan and commits their rounds alone;
membership is shard 0's (heartbeats), and the other shards evict whom shard 0 evicted. A run
of two workers through two shards, one of them killed at a point of a fragment round and
restarted on its state, ends where `diloco simulate`'s one model ends (rtol 1e-5), with every
fragment round applied once, on the shard that owns it.

All of it runs with `-m slow` (about 2 minutes); the default suite checks streaming shards
over raw HTTP with hand-worked weights (tests/server/test_server_http_shard_streaming.py).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from test_e2e_shard_crash import SHARDS, ShardKill, Shards, finish, train
from test_e2e_streaming import simulated_streaming

from diloco.faults import ENV_VAR
from diloco.worker import DiLoCoClient, RetryPolicy
from processes import start_worker

STEPS = 16
STREAMING = (
    "--mode", "streaming", "--sync-every", "4", "--fragments", "2", "--delay", "1",
    "--alpha", "0.5", "--min-workers", "2",
)  # fmt: skip
KILLS = [
    ShardKill("shard 1 writing its initial weights", 1, "checkpoint_file:1"),
    ShardKill("shard 1 right after a fragment commit", 1, "result_published:2"),
    ShardKill("shard 0 mid-upload", 0, "upload_chunk:3"),
    ShardKill("shard 0 inside a fragment barrier", 0, "submission_folded:3"),
    ShardKill("shard 1 during a fragment checkpoint", 1, "checkpoint_file:3"),
    ShardKill("shard 1 checkpoint durable, SQLite not yet", 1, "after_checkpoint:2"),
]
CI_POINT = "shard 1 right after a fragment commit"


def fragment_rows(out: Path, shard: int) -> list[tuple[int, int, int]]:
    with sqlite3.connect(out / f"state-{shard}" / "state.sqlite") as db:
        return db.execute(
            "SELECT round, fragment, fragment_round FROM rounds ORDER BY round"
        ).fetchall()


def owned_fragments(url: str) -> list[int]:
    with DiLoCoClient(url, retry=RetryPolicy(attempts=5)) as client:
        return client.info()["shards"]["fragments"]


def check_fragment_rounds(out: Path, urls: list[str], per_fragment: int) -> None:
    """Each shard applied only its own fragments' rounds, each once, in order; together the
    shards hold every fragment."""
    owners = [owned_fragments(url) for url in urls]
    assert sorted(f for mine in owners for f in mine) == [0, 1], owners
    for shard, mine in enumerate(owners):
        rows = fragment_rows(out, shard)
        assert [r for r, _, _ in rows] == list(range(len(rows))), rows
        for fragment in mine:
            rounds = [fr for _, f, fr in rows if f == fragment]
            assert rounds == list(range(per_fragment)), (shard, fragment, rows)
        assert {f for _, f, _ in rows} <= set(mine), (shard, rows)


@pytest.mark.slow  # the default suite's streaming shards: test_server_http_shard_streaming.py
def test_a_streaming_shard_killed_after_a_fragment_commit_ends_like_the_simulator(
    corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    (kill,) = [k for k in KILLS if k.name == CI_POINT]
    run_with_kill(kill, corpus_file, small_corpus, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kill", [k for k in KILLS if k.name != CI_POINT], ids=str)
def test_a_streaming_shard_killed_at_a_point_ends_like_the_simulator(
    kill: ShardKill, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    run_with_kill(kill, corpus_file, small_corpus, tmp_path)


@pytest.mark.slow  # the default suite's: test_server_http_shard_streaming.py's int8 fragment
def test_streaming_shards_with_int8_both_ways_under_a_kill_end_like_the_simulator(
    corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """Issue 28, item 1: each shard folds its fragments' int8 uploads (error feedback on)
    and codes their int8 deltas as one server would; shard 1 SIGKILLed right after a
    fragment commit and restarted on its state, the run ends where the simulator ends with
    int8 both ways."""
    (kill,) = [k for k in KILLS if k.name == CI_POINT]
    codecs = {"upload_codec": "int8", "download_codec": "int8"}
    run_with_kill(kill, corpus_file, small_corpus, tmp_path, codecs)


def run_with_kill(
    kill: ShardKill,
    corpus: Path,
    small_corpus: bytes,
    out: Path,
    codecs: dict[str, str] | None = None,
) -> None:
    options = [f"--{name.replace('_', '-')}={value}" for name, value in (codecs or {}).items()]
    shards = Shards(out, env={kill.shard: {ENV_VAR: kill.spec}}, mode=(*STREAMING, *options))
    try:
        workers = train(shards.urls[1], corpus, out)  # one URL, not shard 0's, is enough
        shards.processes[kill.shard].wait(timeout=180)
        assert shards.processes[kill.shard].returncode == -signal.SIGKILL, kill
        shards.restart(kill.shard)
        finish(workers, out)
        weights, versions = shards.weights()
        simulated = simulated_streaming(
            small_corpus, workers=2, steps=STEPS, delay=1, alpha=0.5, **(codecs or {})
        )
        per_fragment = simulated.outer_steps // 2
        assert sum(versions) == simulated.outer_steps, versions
        check_fragment_rounds(out, shards.urls, per_fragment)
    finally:
        shards.stop()
    assert weights.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for i in range(SHARDS):
        report = json.loads((out / f"w{i}.json").read_text())
        assert report["fragment_rounds"] == [per_fragment, per_fragment], report
        assert report["fragment_failures"] == 0, report


@pytest.mark.slow
def test_a_worker_evicted_on_shard_0_is_evicted_on_every_shard(
    corpus_file: Path, tmp_path: Path
) -> None:
    """One of two workers dies (SIGKILL): shard 0 evicts it on its heartbeat timeout, shard 1
    follows, and the other worker's fragment rounds go on on both shards without it."""
    mode = tuple("1" if a == "2" and i and STREAMING[i - 1] == "--min-workers" else a
                 for i, a in enumerate(STREAMING))  # fmt: skip
    shards = Shards(tmp_path, mode=(*mode, "--heartbeat-timeout", "3"))
    try:
        # the doomed worker first: the survivor's 40 steps take a few seconds, and under a
        # loaded -n 3 it once ended them before the other's fresh process had registered
        doomed = start_worker(shards.urls[1], "w1", 1, 2, 400, corpus_file, tmp_path)
        with (
            DiLoCoClient(shards.urls[0], retry=RetryPolicy(attempts=20)) as client,
            DiLoCoClient(shards.urls[1], retry=RetryPolicy(attempts=20)) as follower,
        ):

            def wait_for(workers: set[str], rounds: int) -> None:
                """Until `workers` are live on both shards and shard 0 is at `rounds`."""
                deadline = time.monotonic() + 120
                while True:
                    status = client.status()
                    live = {w["worker_id"] for w in status["workers"] if w["live"]}
                    there = {w["worker_id"] for w in follower.status()["workers"] if w["live"]}
                    if live == there == workers and status["round"] >= rounds:
                        return
                    assert time.monotonic() < deadline, (workers, live, there, status["round"])
                    time.sleep(0.05)

            wait_for({"w1"}, 0)
            survivor = start_worker(shards.urls[1], "w0", 0, 2, 40, corpus_file, tmp_path)
            wait_for({"w0", "w1"}, 2)  # both registered on both shards, rounds going on
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        finish([survivor], tmp_path)
    finally:
        shards.stop()
    for shard in range(SHARDS):
        with sqlite3.connect(tmp_path / f"state-{shard}" / "state.sqlite") as db:
            events = {e for (e,) in db.execute("SELECT event FROM audit WHERE worker_id = 'w1'")}
        expected = "evicted" if shard == 0 else "evicted_on_shard_0"
        assert expected in events, (shard, events)
