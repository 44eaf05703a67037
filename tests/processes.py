"""Worker processes for the end-to-end tests: `diloco worker` on the tiny model, and the
server's final weights as a test reads them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import torch

from diloco.wire import decode_tensors
from diloco.worker import DiLoCoClient, RetryPolicy
from tiny import TINY_CLI
from zygote import popen


def sampled(cases: list, ids: list[str], every: int = 3) -> list:
    """Parametrize `cases` (tuples of arguments) with every `every`-th case in the default
    suite and the rest marked slow (`make test-slow` runs them all): each case of a CLI's
    bad-input list starts a process, and the default suite must stay within its budget."""
    import pytest

    return [
        pytest.param(*case, id=name, marks=() if i % every == 0 else (pytest.mark.slow,))
        for i, (case, name) in enumerate(zip(cases, ids, strict=True))
    ]


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key (its own CA)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        import pytest

        pytest.skip("openssl is needed to make a test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


STARTED: list[subprocess.Popen] = []  # every worker process a test started (see reap_workers)


def reap_workers() -> None:
    """Kill the workers a test left running (it failed or timed out), so none outlives it."""
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def start_worker(
    url: str,
    worker_id: str,
    shard: int,
    shards: int,
    steps: int,
    corpus: Path,
    out: Path,
    seed: int = 5,
    extra: tuple[str, ...] = (),
    dispatch: str | None = "static",
    env: dict[str, str] | None = None,
    **popen_options: object,
) -> subprocess.Popen:
    """`diloco worker` on the tiny model; its log and --json land in `out` under its id
    (`popen_options` go to Popen, and start a fresh interpreter rather than a fork)."""
    process = popen(
        [
            sys.executable,
            "-m",
            "diloco.cli",
            "worker",
            "--server",
            url,
            "--worker-id",
            worker_id,
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--shard",
            str(shard),
            "--num-shards",
            str(shards),
            "--corpus",
            str(corpus),
            "--no-progress",
            "--json",
            str(out / f"{worker_id}.json"),
            *(("--data-dispatch", dispatch) if dispatch else ()),
            *TINY_CLI,
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=(out / f"{worker_id}.log").open("wb"),
        env=None if env is None else {**os.environ, **env},
        **popen_options,
    )
    STARTED.append(process)
    return process


def wait_all(processes: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))


def global_weights(url: str) -> tuple[dict[str, torch.Tensor], int]:
    with DiLoCoClient(url, retry=RetryPolicy(attempts=3), read_timeout=30) as client:
        body, round_number = client.get_weights()
    return decode_tensors(body), round_number


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(
    script: str, *args: str, timeout: float = 120, one_thread: bool = False
) -> subprocess.CompletedProcess:
    """Run benchmarks/`script` with `args`, output captured; `one_thread` sets OMP to 1 (tiny
    models crawl with spinning threads on a busy machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else None
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def process_group(args: list[str], ranks: int, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python ARGS` as `ranks` processes of one torch.distributed group, started as torchrun
    starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT for init_process_group's env://) without
    torchrun's own interpreter and agent (about 3 s a group; the DDP group test of
    tests/worker/test_worker_distributed.py runs under torchrun itself). Each
    rank's stderr lines are prefixed "[rankN]:" as torchrun prefixes them; stdout is the
    ranks' in rank order; the exit status is the first rank's that failed. Every rank has a
    session of its own and is killed whole if the group outlives `timeout`."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
             "LOCAL_WORLD_SIZE": str(ranks)}  # fmt: skip
    processes = [
        subprocess.Popen(
            [sys.executable, *args],
            env={**os.environ, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(ranks)
    ]
    outputs: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    codes = [process.returncode for process in processes]
    stderr = "".join(
        f"[rank{rank}]:{line}\n"
        for rank, (_, err) in enumerate(outputs)
        for line in err.splitlines()
    )
    failed = [code for code in codes if code != 0]
    return subprocess.CompletedProcess(
        args, failed[0] if failed else 0, "".join(out for out, _ in outputs), stderr
    )


def load_benchmark(script: str) -> ModuleType:
    """benchmarks/`script` imported as a fresh module of its own name (registered in
    sys.modules, which dataclasses look their module up in), its neighbours importable
    while it loads: for tests that call or patch a benchmark's functions."""
    import importlib.util

    name = Path(script).stem
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def run_benchmark_in_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/`script` run as `__main__` in this process with `args`: its exit code and
    both streams, without a new interpreter (about 2.5 s of imports per case). For the
    benchmarks' refusals, which exit before any work (a run that measures gets a process of
    its own: `run_benchmark`)."""
    import contextlib
    import io
    import runpy

    stdout, stderr = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(BENCHMARKS / script), *args]
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv = argv
        sys.path[:] = path
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, exit status 1
        stderr.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(
        [script, *args], code or 0, stdout.getvalue(), stderr.getvalue()
    )


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """The `diloco` command run by typer's test runner in this process: its exit code and both
    streams, without a new interpreter (about 2 s of imports per case). An exception the
    command let escape is raised here, as the traceback a user would have seen."""
    from typer.testing import CliRunner

    from diloco.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def run_each_in_process(commands: dict[str, list[str]]) -> dict[str, tuple]:
    """`run_all`'s answer, each command run in this process (`run_cli_in_process`)."""
    outcomes = {}
    for label, args in commands.items():
        done = run_cli_in_process(*args)
        outcomes[label] = (done.returncode, done.stdout, done.stderr)
    return outcomes


def run_all(
    commands: dict[str, list[str]], env: dict[str, dict[str, str]] | None = None
) -> dict[str, tuple]:
    """Run every command at once (each pays the interpreter's start-up), with `env[label]`
    added to the environment; (code, stdout, stderr) per label."""
    base = {k: v for k, v in os.environ.items() if k != "DILOCO_TOKEN"}
    processes = {
        label: subprocess.Popen(
            [sys.executable, "-m", "diloco.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **(env or {}).get(label, {})},
        )
        for label, args in commands.items()
    }
    outcomes = {}
    try:
        for label, process in processes.items():
            stdout, stderr = process.communicate(timeout=180)
            outcomes[label] = (process.returncode, stdout, stderr)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    return outcomes


def applied_samples(traces: list[Path], state: Path) -> Counter:
    """How often each (epoch, index) sample went into the global model: the workers' traces
    (DILOCO_TRACE_SAMPLES) joined with the server's submissions table."""
    with sqlite3.connect(state / "state.sqlite") as db:
        applied = set(db.execute("SELECT worker_id, round FROM submissions"))
    seen: dict[tuple[str, int], list] = {}
    for trace in traces:
        for line in trace.read_text().splitlines():
            entry = json.loads(line)
            # A resumed worker that sends a round again trains the same samples; the server
            # keeps the first arrival, so the first line of a (worker, round) is the one.
            seen.setdefault((entry["worker"], entry["round"]), entry["samples"])
    counts: Counter = Counter()
    for key, samples in seen.items():
        if key in applied:
            counts.update((epoch, index) for epoch, index in samples)
    return counts
