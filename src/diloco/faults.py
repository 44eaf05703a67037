"""Named crash points for the crash-equivalence tests: the server kills itself with SIGKILL there.

`DILOCO_CRASH_AT=<point>:<n>` makes the n-th time the process reaches `crash_point(<point>)` a
`kill -9` of itself, so a test can put the crash exactly inside a checkpoint write or between
the checkpoint and the SQLite commit, where an outside kill would land only by luck.
`DILOCO_FAIL_AT=<point>:<n>` makes the n-th arrival raise OSError instead (a disk that fails
once), for the tests of what a failed write leaves served. `DILOCO_STALL_AT=<point>:<seconds>`
sleeps that long at every arrival (a slow disk under a checkpoint write), for the tests of what
the server answers meanwhile. Unset (the only case outside tests) each check is one comparison.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

ENV_VAR = "DILOCO_CRASH_AT"
FAIL_ENV_VAR = "DILOCO_FAIL_AT"
STALL_ENV_VAR = "DILOCO_STALL_AT"

T = TypeVar("T")

_lock = threading.Lock()
_counts: dict[str, int] = {}


def _spec(variable: str, convert: Callable[[str], T]) -> tuple[str, T] | None:
    """`<point>:<value>` from the environment (value 1 when left out), or None when unset."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    point, _, value = spec.partition(":")
    return point, convert(value or "1")


_TARGET = _spec(ENV_VAR, int)
_FAILURE = _spec(FAIL_ENV_VAR, int)
_STALL = _spec(STALL_ENV_VAR, float)
ENABLED = _TARGET is not None


async def watch_chunks(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass an upload through, with the crash point `upload_chunk` after every chunk."""
    async for chunk in chunks:
        yield chunk
        crash_point("upload_chunk")


def crash_point(name: str) -> None:
    """SIGKILL this process if it is the configured point's n-th arrival (OSError if it is the
    failure point's, a sleep if it is the stall point's); otherwise nothing."""
    if _STALL is not None and _STALL[0] == name:
        time.sleep(_STALL[1])
    if _FAILURE is not None and _FAILURE[0] == name:
        with _lock:
            key = "fail:" + name
            _counts[key] = _counts.get(key, 0) + 1
            if _counts[key] == _FAILURE[1]:
                raise OSError(errno.EIO, f"injected failure at {name} ({FAIL_ENV_VAR})")
    if _TARGET is None or _TARGET[0] != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] == _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
