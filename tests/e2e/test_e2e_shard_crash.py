"""Crash equivalence across sharded servers: shards killed with SIGKILL at named points of the
cross-shard commit (a slice held but the round not decided, a decision durable on shard 0 but
not applied on shard 1, inside a checkpoint write...) or from outside at seeded random moments,
each restarted on its port and state dir, end bit-identical to an unbroken sharded run; every
round is applied exactly once on every shard, with the same contributors on each.

The default suite runs one point against the simulator; `-m slow` runs every point and the
random kills against an unbroken sharded run, bit for bit.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco.faults import ENV_VAR
from diloco.server.ops.launch import free_ports, start_server, stop_process
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.net.admin_client import AdminClient
from processes import global_weights, start_worker, wait_all

STEPS, SYNC_EVERY, SHARDS = 16, 4, 2
ROUNDS = STEPS // SYNC_EVERY
SYNC_MODE = ("--sync-every", str(SYNC_EVERY), "--min-workers", "2")


class Shards:
    """S shard processes on fixed ports and state dirs, which can be killed and restarted."""

    def __init__(
        self,
        out: Path,
        env: dict[int, dict[str, str]] | None = None,
        mode: tuple[str, ...] = SYNC_MODE,
        heartbeat_timeout: float = 30,
    ) -> None:
        self.out = out
        self.mode = mode
        self.heartbeat_timeout = heartbeat_timeout
        self.ports = free_ports(SHARDS)
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.processes: list[subprocess.Popen] = []
        self.starts = 0
        for shard in range(SHARDS):
            self.processes.append(self._start(shard, (env or {}).get(shard)))

    def _start(self, shard: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.starts += 1
        urls = [option for url in self.urls for option in ("--shard-url", url)]
        process, _ = start_server(
            self.out / f"port-{shard}-{self.starts}",
            "--port",
            str(self.ports[shard]),
            "--shard",
            str(shard),
            *urls,
            "--state-dir",
            str(self.out / f"state-{shard}"),
            *self.mode,
            "--heartbeat-interval",
            "0.3",
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            output=(self.out / f"shard-{shard}.log").open("ab"),
            env=env,
        )
        return process

    def restart(self, shard: int) -> None:
        self.processes[shard].wait(timeout=60)
        self.processes[shard] = self._start(shard)

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)

    def weights(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        tensors: dict[str, torch.Tensor] = {}
        rounds = []
        for url in self.urls:
            part, round_number = global_weights(url)
            tensors.update(part)
            rounds.append(round_number)
        return tensors, rounds


def train(url: str, corpus: Path, out: Path, count: int = 2) -> list[subprocess.Popen]:
    return [
        start_worker(url, f"w{i}", i, count, STEPS, corpus, out, extra=("--max-retry-delay", "1"))
        for i in range(count)
    ]


def finish(workers: list[subprocess.Popen], out: Path) -> None:
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (out / f"w{i}.log").read_text()


def start_paused(url0: str, worker_url: str, corpus: Path, out: Path):
    """Workers started while shard 0 is paused, resumed once both are live: no step is made
    before both are (an async window then holds both; a sync round whose first submission
    came before the second worker registered is the first worker's alone, and the second
    joins the next)."""
    admin = AdminClient(url0, retry=RetryPolicy(attempts=20))
    with admin, DiLoCoClient(url0, retry=RetryPolicy(attempts=20)) as client:
        admin.pause()
        workers = train(worker_url, corpus, out)
        deadline = time.monotonic() + 120
        while sum(w["live"] for w in client.status()["workers"]) < 2:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.05)
        admin.resume()
    return workers


# with error feedback (not int8's default): the residuals ride through the kills too
INT8_BOTH_WAYS = (
    *SYNC_MODE, "--upload-codec", "int8", "--download-codec", "int8",
    "--error-feedback-beta", "0.95",
)  # fmt: skip


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path):
    return unbroken_run(tmp_path_factory, corpus_file, SYNC_MODE)


@pytest.fixture(scope="module")
def unbroken_int8(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path):
    return unbroken_run(tmp_path_factory, corpus_file, INT8_BOTH_WAYS)


def unbroken_run(
    tmp_path_factory: pytest.TempPathFactory,
    corpus_file: Path,
    mode: tuple[str, ...],
    count: int = 2,
) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("unbroken-shards")
    shards = Shards(out, mode=mode)
    try:
        finish(train(shards.urls[0], corpus_file, out, count), out)
        weights, rounds = shards.weights()
    finally:
        shards.stop()
    assert rounds == [ROUNDS] * SHARDS
    check_applied_once(out, count)
    return weights


def check_applied_once(out: Path, workers: int = 2) -> None:
    """Rounds 0..R-1 once each on every shard (the table's key refuses a second), with the
    same contributors everywhere: shard 0's decision, every one of the `workers`."""
    seen = []
    for shard in range(SHARDS):
        with sqlite3.connect(out / f"state-{shard}" / "state.sqlite") as db:
            rows = db.execute("SELECT round, contributors FROM rounds ORDER BY round").fetchall()
        assert [r for r, _ in rows] == list(range(ROUNDS)), (shard, rows)
        seen.append(rows)
    assert all(rows == seen[0] for rows in seen), seen
    every = json.dumps([f"w{i}" for i in range(workers)])
    assert all(c == every for _, c in seen[0]), seen[0]


@dataclass(frozen=True)
class ShardKill:
    name: str
    shard: int
    spec: str

    def __str__(self) -> str:
        return self.name


KILLS = [
    ShardKill("shard 1 holds a slice, round undecided", 1, "submission_folded:3"),
    ShardKill("shard 0 holds a slice, round undecided", 0, "submission_folded:3"),
    ShardKill("shard 0 deciding, before its checkpoint", 0, "before_checkpoint:2"),
    ShardKill("shard 0 decided durably, shard 1 not yet", 0, "after_store_commit:2"),
    ShardKill("shard 1 applying the decision, checkpoint written", 1, "after_checkpoint:2"),
    ShardKill("shard 1 applied the decision, result unpublished", 1, "after_store_commit:3"),
]
CI_POINT = "shard 0 decided durably, shard 1 not yet"


def run_with_kill(
    kill: ShardKill, corpus: Path, out: Path, mode: tuple[str, ...] = SYNC_MODE, count: int = 2
) -> dict[str, torch.Tensor]:
    """`count` workers through two shards, `kill.shard` dying at `kill.spec` once and
    restarted; the joined final weights, once every shard is at the last round."""
    shards = Shards(out, env={kill.shard: {ENV_VAR: kill.spec}}, mode=mode)
    try:
        workers = train(shards.urls[1], corpus, out, count)  # one URL, not shard 0's, is enough
        shards.processes[kill.shard].wait(timeout=180)
        assert shards.processes[kill.shard].returncode == -signal.SIGKILL, kill
        shards.restart(kill.shard)
        finish(workers, out)
        weights, rounds = shards.weights()
    finally:
        shards.stop()
    assert rounds == [ROUNDS] * SHARDS
    check_applied_once(out, count)
    return weights


def test_shard_0_killed_after_deciding_ends_where_the_simulator_ends(
    corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """The default suite's sample, checked against an independent reference: the simulator's
    one model (shards fold in worker-id order, so rtol 1e-5, not bit for bit)."""
    from e2e.test_e2e_sync import simulated_run

    (kill,) = [k for k in KILLS if k.name == CI_POINT]
    weights = run_with_kill(kill, corpus_file, tmp_path)
    simulated = simulated_run(small_corpus, workers=2, steps=STEPS)
    assert weights.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kill", KILLS, ids=str)
def test_a_shard_killed_at_a_point_of_the_commit_ends_as_unbroken(
    kill: ShardKill, unbroken, corpus_file: Path, tmp_path: Path
) -> None:
    weights = run_with_kill(kill, corpus_file, tmp_path)
    assert weights.keys() == unbroken.keys()
    for name, tensor in unbroken.items():
        assert torch.equal(weights[name], tensor), name


def kill_at_random(
    shards: Shards, workers: list, seed: int, delays: tuple[float, float], kills: int = 3
) -> list[int]:
    """SIGKILL a seeded random shard after a seeded delay in `delays`, `kills` times, each
    restarted on its port and state; the shards killed."""
    rng = random.Random(seed)
    killed: list[int] = []

    def killer() -> None:
        for _ in range(kills):
            time.sleep(rng.uniform(*delays))
            if all(w.poll() is not None for w in workers):
                return
            shard = rng.randrange(SHARDS)
            shards.processes[shard].send_signal(signal.SIGKILL)
            killed.append(shard)
            shards.restart(shard)

    thread = threading.Thread(target=killer)
    thread.start()
    thread.join(timeout=300)
    return killed


def random_kills_end_as(
    unbroken: dict[str, torch.Tensor], corpus: Path, out: Path, seed: int, mode: tuple[str, ...]
) -> None:
    """Three SIGKILLs from outside, each of a seeded random shard after a seeded delay: the
    run ends bit-identical to `unbroken`, each round applied once on every shard."""
    shards = Shards(out, mode=mode)
    try:
        workers = train(shards.urls[1], corpus, out)
        # (a 16-step run takes about 4 s here: every kill lands in it, most after the first
        # round, since the workers start in about 2 s)
        killed = kill_at_random(shards, workers, seed=seed, delays=(0.5, 2.5))
        finish(workers, out)
        weights, rounds = shards.weights()
    finally:
        shards.stop()
    assert killed, "no shard was killed: the run ended first"
    assert rounds == [ROUNDS] * SHARDS
    for name, tensor in unbroken.items():
        assert torch.equal(weights[name], tensor), name
    check_applied_once(out)


@pytest.mark.slow
def test_random_shards_killed_at_random_moments_end_as_unbroken(
    unbroken, corpus_file: Path, tmp_path: Path
) -> None:
    random_kills_end_as(unbroken, corpus_file, tmp_path, seed=15, mode=SYNC_MODE)


@pytest.mark.slow
def test_a_shard_that_stops_answering_holds_every_shard_at_one_version(
    unbroken, corpus_file: Path, tmp_path: Path
) -> None:
    """Shard 1 frozen (SIGSTOP) for 6 s mid-run: workers retry it, shard 0 commits no round
    its slices are missing from (no partial step), and after SIGCONT the run ends as an
    unbroken one."""
    from diloco.worker import DiLoCoClient, RetryPolicy

    shards = Shards(tmp_path)
    try:
        workers = train(shards.urls[0], corpus_file, tmp_path)
        with DiLoCoClient(shards.urls[0], retry=RetryPolicy(attempts=3)) as client:
            deadline = time.monotonic() + 120
            while client.status()["round"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            shards.processes[1].send_signal(signal.SIGSTOP)
            frozen_at = client.status()["round"]
            versions = set()
            for _ in range(30):
                time.sleep(0.2)
                versions.add(client.status()["round"])
            # at most the round shard 1 had already confirmed slices of can commit
            assert max(versions) <= frozen_at + 1, versions
            shards.processes[1].send_signal(signal.SIGCONT)
        finish(workers, tmp_path)
        weights, rounds = shards.weights()
    finally:
        shards.processes[1].send_signal(signal.SIGCONT)
        shards.stop()
    assert rounds == [ROUNDS] * SHARDS
    for name, tensor in unbroken.items():
        assert torch.equal(weights[name], tensor), name
    check_applied_once(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill", [k for k in KILLS if k.shard == 0 or "applying" in k.name], ids=str
)
def test_int8_both_ways_a_shard_killed_in_the_commit_ends_as_unbroken(
    kill: ShardKill, unbroken_int8, corpus_file: Path, tmp_path: Path
) -> None:
    """Issue 28, item 1's check: with int8 uploads and int8 delta downloads, a shard killed
    at a point of the commit (shard 0 before and after deciding, a follower applying) and
    restarted ends bit-identical to the unbroken int8 run, each round applied once."""
    weights = run_with_kill(kill, corpus_file, tmp_path, mode=INT8_BOTH_WAYS)
    assert weights.keys() == unbroken_int8.keys()
    for name, tensor in unbroken_int8.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill", [k for k in KILLS if "applying" in k.name or "before its checkpoint" in k.name], ids=str
)
def test_top_k_with_sparse_mean_a_shard_killed_in_the_commit_ends_like_the_simulator(
    kill: ShardKill, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """Issue 28, item 1: top-k uploads averaged over each element's senders (the codec's
    sparse_mean, counted on each shard as it folds its decided slices); a shard killed
    deciding or applying a round and restarted (a follower folds its held slices again
    from disk) ends where the simulator's one model ends with the same codec."""
    from e2e.test_e2e_sync import simulated_run

    codec = "topk:0.1+int2"
    weights = run_with_kill(kill, corpus_file, tmp_path, mode=(*SYNC_MODE, "--upload-codec", codec))
    simulated = simulated_run(
        small_corpus, workers=2, steps=STEPS, upload_codec=codec, aggregation="sparse_mean"
    )
    assert weights.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_int8_both_ways_random_shard_kills_end_as_unbroken(
    unbroken_int8, corpus_file: Path, tmp_path: Path
) -> None:
    random_kills_end_as(unbroken_int8, corpus_file, tmp_path, seed=21, mode=INT8_BOTH_WAYS)


@pytest.mark.slow
def test_a_follower_and_a_decided_worker_both_killed_the_follower_recovers_its_slices(
    corpus_file: Path, tmp_path: Path
) -> None:
    """Issue 28, item 3's check, int8 both ways: shard 1 dies applying a decision (the round
    is decided on shard 0, not yet on shard 1), and w1, whose slice that decision names, is
    SIGKILLed before shard 1 is back, so it can never send its slice again. The restarted
    shard 1 takes the slices it held back from its state dir and applies the round; w0 ends
    the run alone once w1 is evicted, every round applied once on both shards alike."""
    mode = ("--sync-every", str(SYNC_EVERY), "--min-workers", "1", "--upload-codec", "int8",
            "--download-codec", "int8", "--error-feedback-beta", "0.95")  # fmt: skip
    env = {1: {ENV_VAR: "before_checkpoint:3"}}
    # w1's eviction once killed waits out the timeout; at 4 s a loaded machine once let w0's
    # heartbeats lapse and round 0 commit with w1 alone, costing w0 that round's work
    shards = Shards(tmp_path, env=env, mode=mode, heartbeat_timeout=10)
    try:
        # no commit before both are live, so neither makes rounds alone for long while the
        # other starts (under load one started late: the round shard 1 died in held no w1)
        workers = start_paused(shards.urls[0], shards.urls[0], corpus_file, tmp_path)
        shards.processes[1].wait(timeout=180)
        assert shards.processes[1].returncode == -signal.SIGKILL
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait(timeout=30)
        with sqlite3.connect(tmp_path / "state-1" / "state.sqlite") as db:
            (applied,) = db.execute("SELECT COUNT(*) FROM rounds").fetchone()
        shards.restart(1)
        wait_all(workers[:1], timeout=180)
        assert workers[0].returncode == 0, (tmp_path / "w0.log").read_text()
        _, rounds = shards.weights()
    finally:
        shards.stop()
    rows = []
    for shard in range(SHARDS):
        with sqlite3.connect(tmp_path / f"state-{shard}" / "state.sqlite") as db:
            rows.append(
                db.execute("SELECT round, contributors FROM rounds ORDER BY round").fetchall()
            )
    # every round once, alike on both shards; w0 in every round from its first on. A worker
    # that registered after a round's first submission joins the next: under load w1 once
    # sent round 0 before w0 had registered (the audit: w1's registration, w0's 0.8 s later,
    # round 0 with w1 alone), and w0's first sync then only fetched the weights, so w0 was
    # in ROUNDS - 1 rounds; else the run may hold one more round for w0's last
    assert rows[0] == rows[1] and [r for r, _ in rows[0]] == list(range(len(rows[0]))), rows
    assert rounds == [len(rows[0])] * SHARDS and len(rows[0]) in (ROUNDS, ROUNDS + 1), rows
    with_w0 = [r for r, c in rows[0] if "w0" in json.loads(c)]
    assert with_w0 == list(range(with_w0[0], len(rows[0]))) and with_w0[0] <= 1, rows
    assert len(with_w0) in (ROUNDS - 1, ROUNDS), rows
    # the round shard 1 was applying when it died needed w1's slice, which only its disk had
    assert rows[1][applied] == (applied, '["w0", "w1"]'), rows
    log = (tmp_path / "shard-1.log").read_text()
    assert f"held slice(s) of round {applied} taken back" in log
