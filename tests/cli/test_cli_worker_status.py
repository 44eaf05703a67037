"""`diloco worker` and `diloco status` as a user runs them: tables, JSON, one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from processes import run_cli_in_process, sampled


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(result: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    # Retry warnings may come first (a worker says why it waits); the error is one last line.
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(line.startswith("WARNING") for line in lines[:-1]), result.stderr
    assert needle in errors[0]


def test_status_shows_round_and_workers(server_process, tmp_path: Path) -> None:
    server = server_process("--sync-every", "3", "--token", "tok")
    out = tmp_path / "status.json"
    result = run_cli("status", server.url, "--token", "tok", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "live workers" in result.stdout and "sync" in result.stdout
    status = json.loads(out.read_text())
    assert status["round"] == 0 and status["workers"] == []
    denied = run_cli("status", server.url, "--token", "wrong")
    one_error_line(denied, 1, "unauthorized")


@pytest.mark.parametrize(
    ("status", "text"),
    [
        ({"waiting_for": []}, "-"),
        ({"waiting_for": ["w0", "w2"], "more_submissions_needed": 0}, "w0, w2"),
        ({"waiting_for": [], "more_submissions_needed": 1}, "1 more submission (--min-workers)"),
        (
            {"waiting_for": ["w1"], "more_submissions_needed": 2},
            "w1, 2 more submissions (--min-workers)",
        ),
    ],
)
def test_status_says_who_a_round_waits_for(status: dict, text: str) -> None:
    from diloco.commands.status import waiting_text

    assert waiting_text(status) == text


def test_status_of_an_unreachable_server_is_one_line() -> None:
    result = run_cli("status", f"http://127.0.0.1:{closed_port()}")
    one_error_line(result, 2, "cannot read the status")


WORKER_BAD_INPUTS = [
    (["--steps", "0"], 2, "steps must be a positive integer"),
    (
        ["--data-dispatch", "static", "--shard", "2", "--num-shards", "2"],
        2,
        "shard must be in [0, 2)",
    ),
    (["--shard", "1", "--num-shards", "2"], 2, "are for --data-dispatch static"),
    (["--data-dispatch", "round-robin"], 2, "--data-dispatch must be server or static"),
    (["--unit-size", "0"], 2, "unit_size must be a positive integer"),
    (["--max-retry-delay", "0"], 2, "--max-retry-delay must be a finite number > 0"),
    (["--corpus", "/nonexistent/corpus.txt"], 2, "does not exist"),
    (["--token-file", "/nonexistent/token"], 2, "--token-file"),
    (["--json", "/nonexistent/dir/w.json"], 2, "--json directory does not exist"),
    (["--give-up-after", "-1"], 2, "--give-up-after must be a finite number >= 0"),
    (["--max-upload-mbps", "0"], 2, "upload rate must be > 0 megabits per second"),
    (["--fragment-timeout", "-1"], 2, "fragment_timeout must be > 0 seconds, got -1.0"),
    (["--threads", "0"], 2, "--threads must be a positive integer, got 0"),
    (["--device", "cuda"], 2, "--device cuda: torch sees no CUDA device on this machine"),
    (["--device", "tpu"], 2, "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    (["--dtype", "fp16"], 2, "--dtype must be fp32 or bf16, got 'fp16'"),
    (["--anchor-device", "gpu"], 2, "--anchor-device must be 'auto', 'cpu' or a device name"),
    ([], 2, "no diloco server answered at"),  # nobody listens on the port
    # from an outside review: each was a traceback (exit 1), or an error after a round
    (["--lr", "nan"], 2, "--lr must be a finite number > 0, got nan"),
    (["--lr", "-1"], 2, "--lr must be a finite number > 0, got -1.0"),
    (["--warmup", "-5"], 2, "--warmup must be >= 0 steps, got -5"),
    (["--give-up-after", "nan"], 2, "--give-up-after must be a finite number >= 0"),
    (["--max-retry-delay", "inf"], 2, "--max-retry-delay must be a finite number > 0"),
    (["--seed", "100000000000000000"], 2, "--seed must be in [0, "),
    (["--eval-batches", "0"], 2, "--eval-batches must be >= 1, got 0"),
    (["--checkpoint-dir", "README.md"], 2, "--checkpoint-dir is not a directory: README.md"),
    (["--json", "README.md/w.json"], 2, "--json is inside a file, not a directory"),
]

WORKER_BAD_INPUT_IDS = [
    "steps",
    "shard",
    "shard-without-static",
    "dispatch",
    "unit-size",
    "retry-delay",
    "corpus",
    "token-file",
    "json",
    "give-up",
    "upload-cap",
    "fragment-timeout",
    "threads",
    "device-cuda",
    "device-tpu",
    "dtype",
    "anchor-device",
    "unreachable",
    "lr-nan",
    "lr-negative",
    "warmup",
    "give-up-nan",
    "retry-delay-inf",
    "seed",
    "eval-batches",
    "checkpoint-dir-file",
    "json-in-file",
]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        pytest.param(*case, id=name)
        for case, name in zip(WORKER_BAD_INPUTS, WORKER_BAD_INPUT_IDS, strict=True)
    ],
)
def test_worker_bad_input_is_one_line(
    args: list[str], code: int, needle: str, corpus_file: Path
) -> None:
    """Every case through typer's runner in this process (the real process: below)."""
    one_error_line(run_cli_in_process("worker", *bad_input_base(corpus_file), *args), code, needle)


def bad_input_base(corpus_file: Path) -> list[str]:
    """A worker that would train 2 steps against a closed port, giving up after 1 s."""
    return [
        "--server", f"http://127.0.0.1:{closed_port()}", "--corpus", str(corpus_file),
        "--steps", "2", "--no-progress", "--give-up-after", "1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "code", "needle"), sampled(WORKER_BAD_INPUTS, WORKER_BAD_INPUT_IDS, every=100)
)
def test_worker_bad_input_is_one_line_from_a_real_process(
    args: list[str], code: int, needle: str, corpus_file: Path
) -> None:
    result = run_cli("worker", *bad_input_base(corpus_file), *args, timeout=180)
    one_error_line(result, code, needle)


@pytest.mark.slow  # sibling: the coordinator's fingerprint_mismatch test names the tensor
def test_worker_with_a_mismatched_model_is_refused_by_name(
    server_process, corpus_file: Path
) -> None:
    server = server_process("--sync-every", "2")
    tiny = [
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--heads",
        "2",
        "--steps",
        "2",
        "--corpus",
        str(corpus_file),
        "--no-progress",
        "--server",
        server.url,
    ]
    first = run_cli("worker", *tiny, "--width", "32", "--depth", "2", "--worker-id", "a")
    assert first.returncode == 0, first.stderr
    second = run_cli("worker", *tiny, "--width", "32", "--depth", "3", "--worker-id", "b")
    one_error_line(second, 1, "fingerprint_mismatch")
    assert "blocks.2." in second.stderr  # the first tensor the server does not know
