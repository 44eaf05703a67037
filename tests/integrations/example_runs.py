"""The examples/ trainer scripts as worker processes, for the integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from processes import STARTED, global_weights

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
