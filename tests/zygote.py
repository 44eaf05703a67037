"""`diloco server` and `diloco worker` processes forked from an interpreter that has already
imported torch and the package, instead of each importing them anew.

Each of the suite's ~120 server and worker processes spent about 3 s of CPU importing torch and
diloco before its first line of work; on this 2-core machine that was most of the default
suite's time. The zygote (one per pytest process) imports them once, single-threaded, and
forks a child per launch. The child is a process of its own, like one `subprocess.Popen`
starts: its own pid, memory, sockets and files; SIGKILL and SIGTERM reach it as they would;
its stdin, stdout and stderr are the descriptors the test gave; argv, environment and working
directory are the launch's; `diloco.faults` reads its crash points again from that
environment. Then it runs `diloco.cli.main()` as `python -m diloco.cli` would, and its exit
status comes back as `Popen.returncode` does (-N for signal N). CLI tests of start-up itself
(bad options, `--help`, the demo, the README's recipe) still start fresh interpreters, as
does any launch whose environment differs from the zygote's in what is read at start-up
(`_READ_AT_START`).

What forked children share that fresh interpreters would not: one str-hash seed per pytest
process (a crash test's unbroken and restarted servers iterate sets alike), and memory
pages inherited from the zygote (peak-memory tests measure differences). So `make test-slow`
runs every process fresh (DILOCO_TESTS_FRESH_PROCESSES=1), and the default suite is the
fast one.

The launch request is JSON over a Unix SOCK_SEQPACKET socket, its descriptors passed with it
(SCM_RIGHTS); the zygote answers the child's pid, then its exit code once it has reaped it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

FRESH_ENV_VAR = "DILOCO_TESTS_FRESH_PROCESSES"  # set: every process a fresh interpreter
_CLI = ["-m", "diloco.cli"]
_MAX_REQUEST = 1 << 20


# ------------------------------------------------------------------ the zygote's side


def _serve(path: str, parent: int) -> None:
    """Import what a server and a worker import, then fork one child per request until the
    test process that started it is gone."""
    import torch  # noqa: F401

    import diloco.cli  # noqa: F401  (the server's, worker's and CLI's modules)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    sys.stdout.flush()
    sys.stderr.flush()
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.data is None:
                connection, _ = listener.accept()
                try:
                    _launch(connection, selector)
                except Exception as exc:  # a bad request: its launcher hears nothing more
                    print(f"zygote: a launch failed: {exc!r}", file=sys.stderr, flush=True)
                    connection.close()
            else:
                pid, connection = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    connection.send(str(os.waitstatus_to_exitcode(status)).encode())
                connection.close()


def _launch(connection: socket.socket, selector: selectors.BaseSelector) -> None:
    """Fork the child a request asks for; answer its pid (its exit code follows)."""
    message, fds, _, _ = socket.recv_fds(connection, _MAX_REQUEST, 3)
    try:
        request = json.loads(message)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
        # nothing imported may have started a thread: a fork copies only this one
        assert threading.active_count() == 1, threading.enumerate()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, selector, connection)
    finally:
        for fd in fds:
            os.close(fd)
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ, (pid, connection))
    with contextlib.suppress(OSError):
        connection.send(str(pid).encode())


def _child(
    request: dict[str, Any],
    fds: list[int],
    selector: selectors.BaseSelector,
    connection: socket.socket,
) -> None:
    """In the forked child: become the launch's process, run the CLI, never return."""
    code: object = 1
    try:
        connection.close()
        for key in list(selector.get_map().values()):  # the listener, the other children
            with contextlib.suppress(OSError):
                os.close(key.fd)
            if key.data is not None:
                key.data[1].close()
        with contextlib.suppress(Exception):
            selector.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as a fresh interpreter has none
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path as `python -m` makes it: the working directory first, then PYTHONPATH
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0] = request["cwd"]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        if "numpy" in sys.modules:  # seeded from the OS in each fresh interpreter
            sys.modules["numpy"].random.seed()
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        import importlib

        import diloco.faults

        importlib.reload(diloco.faults)  # its crash points are read from the environment
        import diloco.cli

        # as `python -m diloco.cli` runs it: the same argv[0] and __main__ (click names the
        # program from both)
        sys.argv = [diloco.cli.__file__, *request["args"]]
        sys.modules["__main__"] = diloco.cli
        diloco.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):  # what an interpreter's exit does
            threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        os._exit(code)


# ------------------------------------------------------------------ the test's side


class ForkedProcess:
    """What the tests use of `subprocess.Popen`, for a child of the zygote."""

    def __init__(self, args: list[str], connection: socket.socket, pid: int,
                 stdout: IO[bytes] | None) -> None:  # fmt: skip
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr = None
        self.stdin = None
        self.returncode: int | None = None
        self._connection = connection
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> int | None:
        if not self._lock.acquire(blocking=timeout != 0.0):
            return self.returncode  # another thread waits for it: poll never blocks
        try:
            if self.returncode is not None:
                return self.returncode
            self._connection.settimeout(timeout)
            try:
                answer = self._connection.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            finally:
                with contextlib.suppress(OSError):
                    self._connection.settimeout(None)
            if not answer:
                # the zygote is gone (it answers every child's status before it closes):
                # nobody can reap or report the child, so it is killed, not left running
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, 9)
                answer = b"-9"
            self.returncode = int(answer)
            self._connection.close()
            return self.returncode
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(None if timeout is None else max(timeout, 0.0))
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *_: object) -> None:
        if self.stdout is not None:
            self.stdout.close()
        self.wait()


# What a fresh interpreter, torch, its libraries or rich read once at start-up or import: a
# launch whose environment differs from the zygote's in any of these starts fresh instead.
_READ_AT_START = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "MALLOC_", "LC_",
                  "GLIBC_TUNABLES", "LANG", "TERM", "COLUMNS", "LINES", "NO_COLOR",
                  "FORCE_COLOR", "TTY_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONIOENCODING",
                  "PYTHONUNBUFFERED", "PYTHONUTF8", "PYTHONDEVMODE", "PYTHONMALLOC")  # fmt: skip


def _read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START)}


class _Zygote:
    """The zygote of this process, started on first use (none after it failed to start)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.process: subprocess.Popen | None = None
        self.started_with: dict[str, str] = {}  # its environment's _READ_AT_START part
        self.failed = False
        self._lock = threading.Lock()

    def socket_path(self) -> str | None:
        with self._lock:
            if self.failed or os.environ.get(FRESH_ENV_VAR):
                return None
            if self.process is not None and self.process.poll() is None:
                return self.path
            directory = tempfile.mkdtemp(prefix="diloco-zygote-")
            atexit.register(shutil.rmtree, directory, True)
            path, log = os.path.join(directory, "socket"), os.path.join(directory, "log")
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            with open(log, "wb") as errors:
                self.process = subprocess.Popen(
                    [sys.executable, __file__, path, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errors,
                    env=env,
                )
            atexit.register(self.process.kill)
            deadline = time.monotonic() + 120
            while not os.path.exists(path):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            # a warning printed at import goes to each fresh process's stderr, once: here it
            # would go to the zygote's log only, so every process starts fresh instead
            if not os.path.exists(path) or os.path.getsize(log):
                self.process.kill()
                self.failed = True
                return None
            self.path = path
            self.started_with = _read_at_start(env)
            return path


_ZYGOTE = _Zygote()


def _descriptor(target: object, default: int, opened: list[int], stdout: int | None) -> int:
    """The descriptor a Popen `stdin/stdout/stderr` argument stands for (opened ones noted)."""
    if target is None:
        return default
    if target == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if target == subprocess.STDOUT:
        assert stdout is not None
        return stdout
    if isinstance(target, int):
        return target
    return target.fileno()  # type: ignore[attr-defined]


def popen(
    command: Sequence[str],
    stdin: object = None,
    stdout: object = None,
    stderr: object = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    **kwargs: object,
) -> subprocess.Popen | ForkedProcess:
    """`subprocess.Popen(command, ...)`, forked from the zygote when `command` is this
    interpreter's `-m diloco.cli ...`, nothing else is asked of it (stdin and stderr not
    pipes, no other Popen options) and its environment agrees with the zygote's in what is
    read at start-up; otherwise a fresh interpreter, as before."""
    args = list(command)
    environment = dict(os.environ if env is None else env)
    forkable = (
        not kwargs
        and args[:1] == [sys.executable]
        and args[1:3] == _CLI
        and subprocess.PIPE not in (stdin, stderr)
    )
    path = _ZYGOTE.socket_path() if forkable else None
    if path is None or _read_at_start(environment) != _ZYGOTE.started_with:
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                                cwd=cwd, **kwargs)  # type: ignore[call-overload]  # fmt: skip
    opened: list[int] = []
    pipe_read: IO[bytes] | None = None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if stdout == subprocess.PIPE:
            read, write = os.pipe()
            opened.append(write)
            pipe_read = os.fdopen(read, "rb")
            out = write
        else:
            out = _descriptor(stdout, 1, opened, None)
        fds = [_descriptor(stdin, 0, opened, None), out, _descriptor(stderr, 2, opened, out)]
        request = {"args": args[3:], "env": environment, "cwd": str(cwd or os.getcwd())}
        connection.settimeout(60)
        connection.connect(path)
        socket.send_fds(connection, [json.dumps(request).encode()], fds)
        pid = int(connection.recv(64))  # (a refused request: b"", a ValueError here)
        connection.settimeout(None)
    except BaseException:
        connection.close()
        if pipe_read is not None:
            pipe_read.close()
        raise
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedProcess(args, connection, pid, pipe_read)


def forking_launches() -> None:
    """`diloco.server.ops.launch` (start_server, start_shards) starts its servers through
    `popen` in this process (its own `subprocess` is left as it is for everyone else)."""
    import types

    from diloco.server.ops import launch

    forking = types.ModuleType("subprocess")
    forking.__dict__.update(subprocess.__dict__)
    forking.Popen = popen  # type: ignore[attr-defined]
    launch.subprocess = forking  # type: ignore[attr-defined]


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
