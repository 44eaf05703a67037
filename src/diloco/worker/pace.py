"""How fast a worker computes, apart from the time its syncs take on the training thread.

DyLU gives slow workers fewer local steps, so it needs each worker's compute speed: the steps of a
sync window divided by the window's wall time less the time the training thread was blocked on its
syncs (coding, waiting on the server, taking the result in). The heartbeat reports the last window's
speed; `diloco worker --json` reports the blocked share of the steady state (from the end of the
first window to close, leaving out start-up skew between workers and the final flush).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pace:
    """Blocked time of the training thread, and the compute speed of each sync window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        # training-thread time spent on syncs: coding what is sent (a sync round's encode, a
        # streaming send), waiting on the server, and taking the result in (apply, a mix)
        self.blocked_seconds = 0.0
        self.windows = 0  # sync windows finished (rounds, async arrivals, fragment merges)
        self.last_window_speed: float | None = None  # steps/s of compute in the last window
        self._window_mark = (self.started, 0, 0.0)  # (when, local step, blocked) at its start
        # (when, blocked seconds) after the first window and when training ended.
        self._steady_from: tuple[float, float] | None = None
        self._steady_to: tuple[float, float] | None = None

    def window_done(self, local_step: int) -> None:
        """A sync window ended at `local_step`: its compute speed is the sample a heartbeat
        reports for DyLU."""
        now = self._clock()
        when, step, blocked = self._window_mark
        compute = (now - when) - (self.blocked_seconds - blocked)
        steps = local_step - step
        if steps > 0 and compute > 0:
            self.last_window_speed = steps / compute
            self.windows += 1
        self._window_mark = (now, local_step, self.blocked_seconds)
        if self._steady_from is None:
            self._steady_from = (now, self.blocked_seconds)

    def speed(self, local_step: int) -> float:
        """The last window's speed; before the first, the average since the start."""
        if self.last_window_speed is not None:
            return self.last_window_speed
        return local_step / max(1e-9, self._clock() - self.started)

    def training_ended(self) -> None:
        self._steady_to = (self._clock(), self.blocked_seconds)

    def steady_blocked_fraction(self) -> float | None:
        """Blocked share of wall time from the end of the first window to the end, or None."""
        if self._steady_from is None or self._steady_to is None:
            return None
        span = self._steady_to[0] - self._steady_from[0]
        if span <= 0:
            return None
        return (self._steady_to[1] - self._steady_from[1]) / span
