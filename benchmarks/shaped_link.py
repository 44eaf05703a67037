"""A slow link on loopback: a TCP proxy that limits bandwidth and adds latency, both ways.

Workers that talk to the server through a `LinkProxy` see what a wide-area link gives them:
each direction is a serial line of `mbps` megabits per second with a one-way delay of half
the round-trip time, so a request of n bytes arrives n / rate + rtt / 2 after it was sent,
behind whatever the line was still carrying. One proxy is one host's link: every connection
through it shares the line (`per_connection=True` gives each connection a line of its own).
The proxy buffers at most about one bandwidth-delay product plus 1 MiB per direction and
stops reading beyond it, so a sender is held back as TCP would hold it (it never sees a fast
link that then stalls).

Used by benchmarks/slow_link.py; `python benchmarks/shaped_link.py --help` runs one alone
(e.g. in front of a server a user starts by hand).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import typer

CHUNK = 64 * 1024


@dataclass(frozen=True)
class LinkShape:
    """A link's rate (each direction, full duplex) and round-trip time."""

    mbps: float
    rtt_ms: float
    per_connection: bool = False  # False: one line shared by every connection (a host's)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mbps) and self.mbps > 0):
            raise ValueError(
                f"the link's rate must be a positive number of Mbit/s, got {self.mbps}"
            )
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"the round-trip time must be >= 0 ms, got {self.rtt_ms}")

    @property
    def bytes_per_second(self) -> float:
        return self.mbps * 1e6 / 8

    @property
    def one_way_seconds(self) -> float:
        return self.rtt_ms / 2000

    def buffer_bytes(self) -> int:
        """What one direction holds before it stops reading: a bandwidth-delay product + 1 MiB."""
        return int(self.bytes_per_second * self.rtt_ms / 1000) + (1 << 20)

    def transfer_seconds(self, nbytes: float, exchanges: int = 1) -> float:
        """The paper projection: `nbytes` at the line's rate plus one round trip per exchange."""
        return nbytes / self.bytes_per_second + exchanges * self.rtt_ms / 1000


@dataclass
class Line:
    """One direction of a link: chunks leave in order, each once the line is free, and
    arrive one way's delay later."""

    shape: LinkShape
    free_at: float = 0.0
    carried: int = 0

    def arrival(self, nbytes: int, now: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.shape.bytes_per_second
        self.carried += nbytes
        return self.free_at + self.shape.one_way_seconds


@dataclass
class LinkProxy:
    """Listens on 127.0.0.1 and forwards every connection to `target` through a shaped link;
    runs its own event loop in a thread (`start`, `stop`, or as a context manager)."""

    target: tuple[str, int]
    shape: LinkShape
    clock: Callable[[], float] = time.monotonic
    up: Line = field(init=False)  # client -> target
    down: Line = field(init=False)  # target -> client
    port: int | None = field(default=None, init=False)
    connections: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.up, self.down = Line(self.shape), Line(self.shape)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start the proxy first"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LinkProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = future.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        """Stop listening and end every connection's pumps: none is left suspended for the
        garbage collector to close once the loop has stopped."""
        assert self._server is not None
        self._server.close()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), timeout=5)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            far_reader, far_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), timeout=10
            )
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        own = self.shape.per_connection
        up = Line(self.shape) if own else self.up
        down = Line(self.shape) if own else self.down
        await asyncio.gather(
            self._pump(reader, far_writer, up),
            self._pump(far_reader, writer, down),
            return_exceptions=True,
        )
        for w in (writer, far_writer):
            w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: Line
    ) -> None:
        """Read as the buffer allows; a second task delivers each chunk at its arrival time."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(
            maxsize=max(4, self.shape.buffer_bytes() // CHUNK)
        )

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                arrival, chunk = item
                wait = arrival - self.clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
            if writer.can_write_eof():
                with contextlib.suppress(OSError):
                    writer.write_eof()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(CHUNK):
                await queue.put((line.arrival(len(chunk), self.clock()), chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(None)
            with contextlib.suppress(ConnectionError, OSError):
                await delivering


def main(
    target: str = typer.Argument(..., help="HOST:PORT to forward to (e.g. a diloco server)."),
    mbps: float = typer.Option(100.0, help="Rate of each direction, megabits per second."),
    rtt_ms: float = typer.Option(50.0, help="Round-trip time added, milliseconds."),
    per_connection: bool = typer.Option(False, help="A line per connection, not per proxy."),
) -> None:
    """Run one proxy until Ctrl-C, printing the URL to give the workers."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"TARGET must be HOST:PORT, got {target!r}")
    if not 1 <= int(port) <= 65535:
        raise typer.BadParameter(f"TARGET's port must be in [1, 65535], got {port}")
    try:
        shape = LinkShape(mbps, rtt_ms, per_connection)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with LinkProxy((host, int(port)), shape) as proxy:
        typer.echo(f"{proxy.url} -> {target} at {mbps:g} Mbit/s, {rtt_ms:g} ms round trip")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    typer.run(main)
