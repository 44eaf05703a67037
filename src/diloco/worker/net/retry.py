"""How long the worker's client waits between attempts, and when it gives up.

A worker never throws its progress away over a network error: it re-sends the same request
(the server deduplicates by worker, round and fragment). The waits grow exponentially so a
restarting server is not hammered, and carry jitter so that many workers cut off at the same
moment do not all come back in the same instant.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Iterator
from dataclasses import dataclass


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require(condition: bool, field: str, rule: str, value: object) -> None:
    if not condition:
        raise ValueError(f"RetryPolicy.{field} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter.

    attempts: total tries of one request, the first included; None retries forever.
    base_delay: the wait before the first retry, in seconds; each later wait doubles.
    max_delay: the cap on any single wait, in seconds.
    jitter: the fraction of each wait that is random; 0 waits exactly, 1 is "full jitter"
        (uniform in [0, wait]), 0.5 waits between half and all of it.
    deadline: total seconds one request may take; no retry starts if its wait would end past
        the deadline. None means no deadline.
    first_contact: total seconds one request may keep retrying while the client has never had
        an answer from its server (a wrong URL, a server not started): it then raises
        ServerUnreachable, its last try at that second. Once any answer came, only the fields
        above bound retries, so a worker rides out a server restart. None means no such bound.
    """

    attempts: int | None = None
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.5
    deadline: float | None = None
    first_contact: float | None = None

    def __post_init__(self) -> None:
        attempts, base, cap = self.attempts, self.base_delay, self.max_delay
        _require(
            attempts is None
            or (isinstance(attempts, int) and not isinstance(attempts, bool) and attempts >= 1),
            "attempts",
            "None or an int >= 1",
            attempts,
        )
        _require(_is_real(base) and math.isfinite(base) and base >= 0, "base_delay", ">= 0", base)
        _require(
            _is_real(cap) and math.isfinite(cap) and cap >= base,
            "max_delay",
            f"finite and >= base_delay ({base!r})",
            cap,
        )
        jitter = self.jitter
        _require(_is_real(jitter) and 0 <= jitter <= 1, "jitter", "in [0, 1]", jitter)
        for name in ("deadline", "first_contact"):  # seconds, or None: no limit
            value = getattr(self, name)
            finite = _is_real(value) and math.isfinite(value) and value > 0
            _require(value is None or finite, name, "None or > 0", value)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Yield the wait before each retry: one fewer than `attempts`, or forever.

        Wait n (from 0) is d = min(max_delay, base_delay * 2**n), jittered to a value in
        [d * (1 - jitter), d]. `rng` makes the jitter reproducible in tests.
        """
        rng = rng or random.Random()
        retries = None if self.attempts is None else self.attempts - 1
        ceiling = min(float(self.base_delay), float(self.max_delay))
        done = 0
        while retries is None or done < retries:
            yield ceiling * (1.0 - self.jitter * rng.random())
            # Doubling a capped value never overflows, however long the retries go on.
            ceiling = min(ceiling * 2.0, float(self.max_delay))
            done += 1
