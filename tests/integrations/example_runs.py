"""The examples/ trainer scripts as worker processes, for the integration tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco.data import TokenWindows, generated_corpus, split_train_val
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.data.trace import TRACE_ENV_VAR
from processes import STARTED, applied_samples, global_weights

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_worker(
    script: str,
    url: str,
    worker_id: str,
    out: Path,
    *extra: str,
    corpus: Path,
    crash_at: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """examples/`script` as a worker: 6 steps, a checkpoint every 3; its log in out/<id>.log;
    `env` adds to the environment."""
    env = {**{k: v for k, v in os.environ.items() if k != "DILOCO_CRASH_AT"}, **(env or {})}
    if crash_at:
        env["DILOCO_CRASH_AT"] = crash_at
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), "--server", url, "--worker-id", worker_id,
         "--corpus", str(corpus), "--steps", "6", "--save-steps", "3", "--batch-size", "4",
         "--seq-len", "32", "--output-dir", str(out / worker_id),
         "--json", str(out / f"{worker_id}.json"), *extra],
        stdout=subprocess.DEVNULL,
        stderr=(out / f"{worker_id}.log").open("ab"),
        env=env,
    )  # fmt: skip
    STARTED.append(process)
    return process


def assert_same_global_weights(url: str, expected_url: str, rounds: int) -> None:
    """Both servers at `rounds` with the same global weights (allclose: thread order)."""
    after, round_after = global_weights(url)
    expected, round_expected = global_weights(expected_url)
    assert round_after == round_expected == rounds
    assert after.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def finished(process: subprocess.Popen, out: Path, worker_id: str, code: int = 0) -> None:
    assert process.wait(timeout=240) == code, (out / f"{worker_id}.log").read_text()[-3000:]


def assert_leased_samples_once(
    script: str, server_process: Callable, tmp_path: Path, crash_at: str
) -> None:
    """Two workers of examples/`script` on server-leased work units of 7 windows, batches of
    4, H = 2. Worker v (16 steps) is killed with kill -9 at `crash_at` (its step-3
    checkpoint, inside round 2, with the next batch fetched ahead), evicted, and resumed;
    w stops after 5 steps, inside a unit. Every window of epoch 0 goes into the global model
    exactly once (the workers' sample traces joined with the server's record of the
    submissions each step applied), and each submission carries exactly the samples of the
    steps it trained: none fetched ahead and never trained."""
    corpus = tmp_path / "small.txt"
    corpus.write_bytes(generated_corpus(num_bytes=1_500, seed=3))
    windows = len(TokenWindows(split_train_val(corpus.read_bytes()).train, 32))
    state = tmp_path / "state"
    server = server_process(
        "--state-dir", str(state), "--sync-every", "2",
        "--heartbeat-interval", "0.3", "--heartbeat-timeout", "2",
    )  # fmt: skip

    def worker(worker_id: str, steps: int, *extra: str, crash: str | None = None):
        trace = tmp_path / f"{worker_id}-{len(list(tmp_path.glob('*.trace')))}.trace"
        return example_worker(script, server.url, worker_id, tmp_path, "--data-dispatch",
                              "server", "--unit-size", "7", "--steps", str(steps), *extra,
                              corpus=corpus, crash_at=crash,
                              env={TRACE_ENV_VAR: str(trace)})  # fmt: skip

    victim = worker("v", 16, crash=crash_at)
    leaver = worker("w", 5)
    finished(victim, tmp_path, "v", code=-signal.SIGKILL)
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=10) as client:
        deadline = time.monotonic() + 60
        while any(w["worker_id"] == "v" and w["live"] for w in client.status()["workers"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)  # evicted: its leases go back to the pool
    resumed = worker("v", 16, "--resume")
    finished(leaver, tmp_path, "w")
    finished(resumed, tmp_path, "v")
    # v was evicted, so its resume drops step 3 whether the server went past the round or
    # gave its units to the pool. 4 samples a step: w's 5 steps (rounds end at steps 2, 4
    # and its last, 5), v's steps 1-2 before the kill, and its steps 4-16 after the resume
    assert "are dropped" in (tmp_path / "v.log").read_text()
    sent = {
        trace.name: sum(len(json.loads(line)["samples"]) for line in trace.open())
        for trace in tmp_path.glob("*.trace")
    }
    assert sorted(sent.values()) == [8, 4 * 5, 4 * 13], sent
    counts = applied_samples(sorted(tmp_path.glob("*.trace")), state)
    epoch0 = {index: n for (epoch, index), n in counts.items() if epoch == 0}
    assert sorted(epoch0) == list(range(windows)), "every window of epoch 0 was trained"
    assert {index: n for index, n in epoch0.items() if n != 1} == {}, "none twice"


def torchrun_example(
    script: str, url: str, out: Path, corpus: Path, *extra: str, crash_at: str = ""
) -> int:
    """examples/`script` as a 2-rank torchrun group, worker g0 (its output in out/g0,
    out/g0.json and out/g0.log); DILOCO_CRASH_AT reaches both ranks. The exit code."""
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_CRASH_AT"}
    if crash_at:
        env["DILOCO_CRASH_AT"] = crash_at
    with socket.socket() as free:  # torchrun's rendezvous port
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    with (out / "g0.log").open("ab") as log:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_addr", "127.0.0.1", "--master_port", port,
             str(EXAMPLES / script),
             "--server", url, "--worker-id", "g0", "--corpus", str(corpus),
             "--steps", "6", "--save-steps", "3", "--batch-size", "4", "--seq-len", "32",
             "--output-dir", str(out / "g0"), "--json", str(out / "g0.json"), *extra],
            stdout=log, stderr=log, env=env, timeout=300, check=False,
        ).returncode  # fmt: skip
