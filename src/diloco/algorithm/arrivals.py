"""How asynchronous arrivals combine: when a grace window closes, and how much a stale one
counts. One rule each for the server and the simulator.

With a grace of S (seconds on the server, simulated time in `diloco simulate`), arrivals
within S of the window's first one are averaged into one outer step. The deadline does not
slide with later arrivals, and the window closes early, at its last arrival, once every
worker still training has arrived. A grace of 0 is no window: each arrival is its own step.

Staleness is the number of outer steps applied between the worker's anchor and the arrival of
its pseudo-gradient. `inverse_sqrt` scales the values (not the weight) by (1 + staleness)^-1/2,
so an old update moves the model less; `none` applies it as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.algorithm._checks import require_choice

STALENESS_WEIGHTINGS = ("none", "inverse_sqrt")


@dataclass(frozen=True)
class GraceWindow:
    """The rule, for one grace; times are the caller's (monotonic seconds, simulated time)."""

    grace: float

    def __post_init__(self) -> None:
        if not (0 <= self.grace < math.inf):
            raise ValueError(f"grace must be a number >= 0, got {self.grace!r}")

    def deadline(self, opened_at: float) -> float:
        return opened_at + self.grace

    def takes(self, opened_at: float, arrival: float) -> bool:
        """Whether an arrival at `arrival` joins the window its first arrival opened."""
        return self.grace > 0 and arrival <= self.deadline(opened_at)

    def closes_at(self, opened_at: float, last_arrival: float, all_arrived: bool) -> float:
        """When the window closes: at once without grace, at its last arrival once nobody
        else is training, else at the deadline."""
        if self.grace <= 0 or all_arrived:
            return last_arrival
        return self.deadline(opened_at)

    def closed(self, opened_at: float, last_arrival: float, all_arrived: bool, now: float) -> bool:
        return now >= self.closes_at(opened_at, last_arrival, all_arrived)


def staleness_scale(staleness: int, weighting: str) -> float:
    """The factor a pseudo-gradient `staleness` outer steps old is multiplied by."""
    require_choice("staleness weighting", weighting, STALENESS_WEIGHTINGS)
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if weighting == "inverse_sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    return 1.0
