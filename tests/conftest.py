"""Shared fixtures: a small generated corpus, and real servers (in a thread or a process)."""

from __future__ import annotations

import os

# Every process of the suite gets one torch thread (a thread budget, commands/threads.py):
# pytest-xdist runs several tests at once on this 2-core machine, each with its own server and
# worker processes (the default suite took 271-336 s so, and 367-389 s without it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco.data import generated_corpus
from diloco.server.coordinator import Coordinator
from diloco.server.http.runner import CoordinatorServer, build_server
from diloco.server.members.credentials import Credentials
from diloco.server.ops.launch import start_server, stop_process
from diloco.server.settings import ServerSettings
from processes import reap_workers
from zygote import forking_launches

forking_launches()  # `diloco server` processes forked from a pre-imported interpreter


@pytest.fixture(scope="session")
def small_corpus() -> bytes:
    return generated_corpus(num_bytes=60_000, seed=7)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory, small_corpus: bytes) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "generated.txt"
    path.write_bytes(small_corpus)
    return path


@dataclass
class RunningServer:
    """A real coordinator behind real uvicorn on 127.0.0.1, in a thread of the test process."""

    url: str
    coordinator: Coordinator
    server: CoordinatorServer


@contextmanager
def serve_in_thread(
    settings: ServerSettings | None = None,
    initial: dict[str, torch.Tensor] | None = None,
    token: str | Credentials | None = None,
    coordinator: Coordinator | None = None,
) -> Iterator[RunningServer]:
    """`coordinator`: served as it is (e.g. one on a state dir) instead of a new one."""
    coordinator = coordinator or Coordinator(settings or ServerSettings(), initial)
    server = build_server(coordinator, "127.0.0.1", 0, token, log_level="warning")
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while server.bound_port is None:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{server.bound_port}", coordinator, server)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture
def live_server() -> Iterator[Callable[..., AbstractContextManager[RunningServer]]]:
    """`with live_server(settings, initial, token) as s:` starts a server; it stops on exit."""
    yield serve_in_thread


@dataclass
class ServerProcess:
    """`diloco server` as a user runs it: a separate process, stopped by the fixture."""

    process: subprocess.Popen
    url: str
    log: Path


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        port_file = tmp_path / f"port-{len(started)}"
        log = tmp_path / f"server-{len(started)}.log"
        try:
            process, url = start_server(  # (a start that hangs dumps its stacks to the log)
                port_file,
                *args,
                output=log.open("wb"),
                timeout=60,
                env={"PYTHONFAULTHANDLER": "1", **(env or {})},
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {log.read_text()}") from None
        running = ServerProcess(process, url, log)
        started.append(running)
        return running

    yield start
    for running in started:
        stop_process(running.process)


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    yield
    reap_workers()


# The modules whose tests start the most real processes go first: pytest-xdist hands a
# module (--dist loadscope) to whichever worker is free, so a long one left for the end keeps
# one worker busy while the other idles.
_LONG_FIRST = (
    "e2e/",
    "integrations/",
    "cli/",
    "benchmarks/",
    "test_server_hardening.py",
    "test_worker_distributed.py",
    "test_worker_fsdp.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not any(part in item.nodeid for part in _LONG_FIRST))
