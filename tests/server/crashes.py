"""An in-process coordinator "killed": what kill -9 leaves of it, for the tests that restart one
on the same state directory."""

from __future__ import annotations

import contextlib

from diloco.server.coordinator import Coordinator


def killed(c: Coordinator) -> None:
    """The files as they are once its last checkpoint, written in the background, is on disk
    (a kill inside that write: tests/server/test_server_journal.py), and the state dir's lock
    released. Waiting for the writer first keeps a dead server's thread from writing beside
    the restarted one, which no real kill -9 leaves."""
    with contextlib.suppress(Exception):  # a failed write: the step log keeps the step
        c.journal.settle()
    c.journal.state.close()
