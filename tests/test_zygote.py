"""The tests' forked `diloco` processes (tests/zygote.py) behave as fresh ones do, as far as
the tests can tell: exit codes, signals, descriptors, environment, working directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zygote import FRESH_ENV_VAR, ForkedProcess, popen

CLI = [sys.executable, "-m", "diloco.cli"]


@pytest.fixture(autouse=True)
def _forking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FRESH_ENV_VAR, raising=False)


def test_a_forked_cli_prints_exits_and_names_itself_as_python_m_does(tmp_path: Path) -> None:
    process = popen([*CLI, "server", "--no-such-option"], stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, cwd=tmp_path)  # fmt: skip
    assert isinstance(process, ForkedProcess)
    assert process.wait(timeout=60) == 2
    assert process.stdout is not None
    output = process.stdout.read().decode()
    process.stdout.close()
    assert "python -m diloco.cli server" in output and "--no-such-option" in output


def test_a_forked_server_has_its_own_pid_cwd_and_environment_and_dies_of_signals(
    tmp_path: Path,
) -> None:
    port_file, log = tmp_path / "port", tmp_path / "server.log"
    with log.open("wb") as output:
        process = popen(
            [*CLI, "server", "--host", "127.0.0.1", "--port", "0", "--port-file", "port",
             "--log-level", "info"],
            stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip
    assert isinstance(process, ForkedProcess) and process.pid != os.getpid()
    deadline = time.monotonic() + 60
    while not port_file.exists():  # a relative --port-file lands in its working directory
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Path(f"/proc/{process.pid}/cwd").resolve() == tmp_path.resolve()
    descriptors = {int(fd) for fd in os.listdir(f"/proc/{process.pid}/fd")}
    assert {0, 1, 2} <= descriptors
    # its environment's PYTHONFAULTHANDLER: SIGABRT dumps its threads' stacks into its log
    process.send_signal(signal.SIGABRT)
    assert process.wait(timeout=30) == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in log.read_text(errors="replace")
    assert process.poll() == -signal.SIGABRT
    process.kill()  # after its exit: nothing, as Popen does


def test_a_wait_that_runs_out_raises_timeout_expired(tmp_path: Path) -> None:
    process = popen([*CLI, "worker", "--server", "http://127.0.0.1:9", "--worker-id", "w",
                     "--steps", "1", "--max-retry-delay", "1"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    assert isinstance(process, ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    assert process.poll() is None
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL


def test_launches_the_zygote_cannot_stand_for_start_fresh(tmp_path: Path) -> None:
    """Another setting read at start-up, a pipe on stderr, another program: subprocess.Popen."""
    other_threads = popen([*CLI, "--help"], stdout=subprocess.DEVNULL,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})  # fmt: skip
    piped = popen([*CLI, "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    other = popen([sys.executable, "-c", "pass"])
    for process in (other_threads, piped, other):
        assert isinstance(process, subprocess.Popen)
        process.communicate(timeout=60)
        assert process.returncode == 0
