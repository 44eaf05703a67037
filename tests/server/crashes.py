"""An in-process coordinator on a state directory, and "killed": what kill -9 leaves of it, for
the tests that restart one on the same directory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore


def killed(c: Coordinator) -> None:
    """The files as they are once its last checkpoint, written in the background, is on disk
    (a kill inside that write: tests/server/test_server_journal.py), and the state dir's lock
    released. Waiting for the writer first keeps a dead server's thread from writing beside
    the restarted one, which no real kill -9 leaves."""
    with contextlib.suppress(Exception):  # a failed write: the step log keeps the step
        c.journal.settle()
    c.journal.state.close()


def on_state_dir(state: Path, settings: ServerSettings, **journal: object) -> Coordinator:
    """A coordinator started (or restarted) on `state`; `journal`: RoundJournal's options.
    The directory's lock is released if the start fails."""
    opened = RoundJournal(StateStore(state), settings, **journal)  # type: ignore[arg-type]
    try:
        return Coordinator(settings, journal=opened)
    except BaseException:
        opened.state.close()
        raise


def flip_last_byte(path: Path) -> None:
    """A state file changed on disk (a bad sector, a partial copy): its hash no longer holds."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether `condition` came true within `seconds` (a background thread's work)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
