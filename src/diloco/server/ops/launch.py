"""Start `diloco server` as a child process on 127.0.0.1 and stop it: for the demo, the
benchmarks and the tests, which all need a real server process and its URL."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO


def diloco_command(*args: str) -> list[str]:
    """The `diloco` CLI of this interpreter (no reliance on the console script being on PATH)."""
    return [sys.executable, "-m", "diloco.cli", *args]


def start_server(
    port_file: Path,
    *args: str,
    output: IO[bytes] | int | None = subprocess.DEVNULL,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start a server on an ephemeral port (later `--port` in `args` wins) and return its URL.

    The server writes the bound port to `port_file` once it listens; a server that exits or
    stays silent past `timeout` is killed and reported as a RuntimeError.
    """
    port_file.unlink(missing_ok=True)  # a stale one would name an old server's port
    process = subprocess.Popen(
        diloco_command(
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-level",
            "warning",
            *args,
        ),
        stdout=output,
        stderr=subprocess.STDOUT if output not in (None, subprocess.DEVNULL) else output,
        env=None if env is None else {**os.environ, **env},
    )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None and (env or {}).get("PYTHONFAULTHANDLER"):
                # still starting: its threads' stacks to `output` first (faulthandler's
                # SIGABRT dump), so a start that hangs says where
                process.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            stop_process(process)
            raise RuntimeError(f"the server did not start (exit code {process.returncode})")
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port_file.read_text().strip()}"


def stop_process(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports that are free now (held open together, so they differ), chosen below the
    kernel's ephemeral range where it has one: a port that a process binds seconds later
    (once its interpreter started) is then never one that another process's `port 0` or
    outgoing connection took meanwhile, as happened to `diloco cluster` beside other servers
    starting in parallel tests."""
    low = _ephemeral_low()
    sockets: list[socket.socket] = []
    try:
        candidates = random.sample(range(10_000, low), min(200, low - 10_000)) if low else []
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:  # no such range: the OS's own choice
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ephemeral_low() -> int | None:
    """The first port of Linux's ephemeral range when it leaves room below it, else None."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if low > 11_000 else None


def start_shards(
    directory: Path,
    count: int,
    *args: str,
    per_shard: Callable[[int], Sequence[str]] = lambda _shard: (),
    output: Callable[[int], IO[bytes] | int] = lambda _shard: subprocess.DEVNULL,
    timeout: float = 120.0,
) -> list[tuple[subprocess.Popen, str]]:
    """Start `count` shard servers on 127.0.0.1 (shard 0 first), each with `args` and its own
    `per_shard(i)` options (a --state-dir); returns (process, URL) of each, in shard order
    (https:// URLs when `args` give --tls-cert: the shards then call each other over TLS)."""
    ports = free_ports(count)
    tls = any(arg == "--tls-cert" or arg.startswith("--tls-cert=") for arg in args)
    scheme = "https" if tls else "http"
    urls = [f"{scheme}://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    started: list[tuple[subprocess.Popen, str]] = []
    try:
        for shard, port in enumerate(ports):
            process, _ = start_server(
                directory / f"shard-{shard}.port",
                *args,
                "--port",
                str(port),
                "--shard",
                str(shard),
                *shared,
                *per_shard(shard),
                output=output(shard),
                timeout=timeout,
            )
            started.append((process, urls[shard]))
    except BaseException:
        for process, _ in started:
            stop_process(process)
        raise
    return started
