"""A client-side cap on upload bandwidth, for workers that share a link (`--max-upload-mbps`).

Uploads are paced in slices: before a slice goes out, the limiter waits until the bytes sent
so far fit under the rate since the link was last idle. Every upload of one client shares the
same limiter, so a streaming worker's background sync and its main thread together stay under
the cap. A body still goes out as one request with its Content-Length (never chunked).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

SLICE_BYTES = 64 * 1024


class UploadLimiter:
    """At most `bytes_per_second` on average over each busy period of the link."""

    def __init__(
        self,
        bytes_per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if not (math.isfinite(bytes_per_second) and bytes_per_second > 0):
            raise ValueError(f"upload rate must be > 0 bytes per second, got {bytes_per_second!r}")
        self.rate = float(bytes_per_second)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the bytes granted so far will have gone out at the rate

    @classmethod
    def from_mbps(cls, megabits_per_second: float) -> UploadLimiter:
        """The limiter of a link of that many megabits per second (ValueError unless > 0)."""
        if not (
            isinstance(megabits_per_second, (int, float)) and 0 < megabits_per_second < math.inf
        ):
            raise ValueError(
                "upload rate must be > 0 megabits per second (max_upload_mbps), "
                f"got {megabits_per_second!r}"
            )
        return cls(megabits_per_second * 1e6 / 8)

    def take(self, nbytes: int) -> None:
        """Block until `nbytes` more may go out."""
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
            wait = start - now
        if wait > 0:
            self._sleep(wait)

    def paced(self, body: bytes | bytearray | memoryview) -> Iterator[memoryview]:
        """The body in slices, each released when the rate allows."""
        view = memoryview(body).cast("B")
        for offset in range(0, view.nbytes, SLICE_BYTES):
            piece = view[offset : offset + SLICE_BYTES]
            self.take(piece.nbytes)
            yield piece
