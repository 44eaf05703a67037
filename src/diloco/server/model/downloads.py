"""Result requests being answered, so that a background checkpoint can wait for them.

A step's checkpoint is written in the background every few rounds (state/journal.py). Started
at the commit, it ran beside the downloads of the step's result: at 85M parameters on this
2-core machine those rounds' downloads took 0.41-0.47 s against 0.13-0.20 s in the others,
and the workers' apply after them 0.14-0.16 s against 0.07-0.10 s. Started once the result
requests that were being answered at the commit have been sent, it runs while the workers
train (benchmarks/results/model_scale-checkpoint-after-downloads/). In sync mode only: there
every result request under way at a commit is for that round's result (or a late reader's
of an earlier one), where in streaming and async mode long polls for other steps are in
flight at any commit and would hold the checkpoint until the next step needs it.

The HTTP layer enters a request as it starts waiting for a result and leaves it once the body
is handed to the socket (or the request ends any other way); the coordinator, which knows
no HTTP, only hands the journal `waiter()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How long a checkpoint waits at most for the downloads under way at its commit: past it the
# checkpoint starts anyway (a result going out over a slow link, a request that never ends).
MAX_WAIT_SECONDS = 10.0


class ResultDownloads:
    """The result requests in flight, each a token from `enter` until its `leave`."""

    def __init__(self, max_wait: float = MAX_WAIT_SECONDS) -> None:
        self.max_wait = max_wait
        self._changed = threading.Condition()
        self._next = 0
        self._open: set[int] = set()

    def enter(self) -> int:
        """A result request starts: its token, for `leave`."""
        with self._changed:
            self._next += 1
            self._open.add(self._next)
            return self._next

    def leave(self, token: int) -> None:
        """The request's answer is out (or it ended otherwise); a second call does nothing."""
        with self._changed:
            self._open.discard(token)
            self._changed.notify_all()

    def in_flight(self) -> int:
        with self._changed:
            return len(self._open)

    def waiter(self) -> Callable[[threading.Event], None]:
        """What to call before a background write: it returns once every request in flight
        now has left, `go` is set (someone needs the write finished), or `max_wait` has
        passed; requests that enter later are not waited for."""
        with self._changed:
            waited_for = frozenset(self._open)
        deadline = time.monotonic() + self.max_wait

        def wait(go: threading.Event) -> None:
            with self._changed:
                while waited_for & self._open and not go.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._changed.wait(remaining)

        return wait

    def wake(self) -> None:
        """Wake the waiters to look at their `go` again (it was just set)."""
        with self._changed:
            self._changed.notify_all()
