"""Which results have gone out to which worker, so that a background checkpoint can wait.

A step's checkpoint is written in the background every few rounds (state/journal.py). Started
at the commit, it ran beside the downloads of the step's result: at 85M parameters on this
2-core machine those rounds' downloads took 0.32-0.48 s against 0.15-0.26 s in the others.
Started once each worker whose body the step used has been sent the step's result, it runs
while the workers train (benchmarks/results/model_scale-checkpoint-after-downloads/).

In sync mode only: there the step's contributors are exactly who fetch its result next. The
HTTP layer reports each result body once the socket has taken it (`sent`); the coordinator,
which knows no HTTP, only hands the journal this object.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

# How long a checkpoint waits at most for its step's downloads: past it the checkpoint starts
# anyway (a result going out over a slow link, a worker that died before it fetched it).
MAX_WAIT_SECONDS = 10.0


class ResultDownloads:
    """The newest result each worker has been sent, by the round it starts."""

    def __init__(self, max_wait: float = MAX_WAIT_SECONDS) -> None:
        self.max_wait = max_wait
        self._changed = threading.Condition()
        self._sent: dict[str, int] = {}

    def sent(self, worker_id: str, round_number: int) -> None:
        """The result that starts `round_number` has gone out to `worker_id` (its body is in
        the socket, all but the transport's low-water mark)."""
        with self._changed:
            if round_number > self._sent.get(worker_id, -1):
                self._sent[worker_id] = round_number
                self._changed.notify_all()

    def waiter(
        self, workers: Collection[str], round_number: int
    ) -> Callable[[threading.Event], None]:
        """What to call before a background write: it returns once each of `workers` has
        been sent the result that starts `round_number`, `go` is set (the next step needs
        the write finished), or `max_wait` has passed since this call."""
        workers = tuple(workers)
        deadline = time.monotonic() + self.max_wait

        def wait(go: threading.Event) -> None:
            with self._changed:
                while not go.is_set() and any(
                    self._sent.get(w, -1) < round_number for w in workers
                ):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._changed.wait(remaining)

        return wait

    def wake(self) -> None:
        """Wake the waiters to look at their `go` again (it was just set)."""
        with self._changed:
            self._changed.notify_all()
