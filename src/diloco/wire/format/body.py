"""Reading a tensor body off the network into one buffer, with the size limits enforced first.

The body lands in a single preallocated bytearray of exactly Content-Length bytes, which
`decode_tensors` then views without copying: a 4 GB upload costs 4 GB, not 8 or 12.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Protocol

from diloco.wire.errors import WireError

_DIGITS = re.compile(r"[0-9]{1,30}")


class ChunkWatcher(Protocol):
    """Sees a body's first chunks until it is `done` (wire.early_header.EarlyHeader)."""

    done: bool

    async def feed(self, chunk: bytes | bytearray | memoryview) -> None: ...


def parse_content_length(header: str | None) -> int | None:
    """The Content-Length header as an int, None when absent; 422 for anything but digits."""
    if header is None:
        return None
    text = header.strip()
    if not _DIGITS.fullmatch(text):
        shown = header if len(header) <= 40 else header[:40] + "..."
        raise WireError(
            422,
            "invalid_request",
            f"Content-Length must be a non-negative integer, got {shown!r}",
            field="Content-Length",
            got=shown,
        )
    return int(text)


def check_length(content_length: int | None, max_bytes: int) -> None:
    """411 without a length, 413 over `max_bytes`: decided before a byte of the body is read."""
    if content_length is None:
        raise WireError(411, "length_required", "a tensor body needs a Content-Length header")
    if content_length < 0:
        raise WireError(
            422,
            "invalid_request",
            f"Content-Length must be a non-negative integer, got {content_length}",
            field="Content-Length",
            got=content_length,
        )
    if content_length > max_bytes:
        raise WireError(
            413,
            "body_too_large",
            f"the body's Content-Length of {content_length} bytes is over the limit of "
            f"{max_bytes} bytes",
            content_length=content_length,
            max_bytes=max_bytes,
        )


async def read_body(
    chunks: AsyncIterator[bytes],
    content_length: int | None,
    max_bytes: int,
    watcher: ChunkWatcher | None = None,
) -> bytearray:
    """Read exactly `content_length` bytes from `chunks` into one bytearray of that size.

    No Content-Length is 411 and one over `max_bytes` is 413, both raised before the first
    chunk is read. A body longer or shorter than declared is 422 invalid_request. `watcher`
    sees each chunk as it lands until it is done (and may refuse the body by raising).
    """
    check_length(content_length, max_bytes)
    assert content_length is not None
    # The body's buffer is allocated once `watcher` has passed its header: a body refused on
    # its header costs the chunks read so far, not Content-Length bytes of memory.
    early: list[bytes] = []
    buffer: bytearray | None = None
    target: memoryview | None = None
    filled = 0
    try:
        async for chunk in chunks:
            size = len(chunk)
            if not size:
                continue
            end = filled + size
            if end > content_length:
                raise WireError(
                    422,
                    "invalid_request",
                    f"the body is longer than its Content-Length of {content_length} bytes",
                    content_length=content_length,
                    received_at_least=end,
                )
            if watcher is not None and not watcher.done:
                await watcher.feed(chunk)
            if target is None and (watcher is None or watcher.done):
                buffer, target = _allocated(content_length, early)
                early = []
            if target is None:
                early.append(bytes(chunk))
            else:
                target[filled:end] = chunk
            filled = end
    finally:
        if target is not None:
            target.release()
    if filled < content_length:
        raise WireError(
            422,
            "invalid_request",
            f"the body ended after {filled} of {content_length} bytes",
            content_length=content_length,
            received=filled,
        )
    if buffer is None:  # (an empty body, or a watcher never done: its header was all of it)
        buffer, view = _allocated(content_length, early)
        view.release()
    return buffer


def _allocated(size: int, chunks: list[bytes]) -> tuple[bytearray, memoryview]:
    """A body's buffer of `size` bytes holding `chunks` at its start, and a view of it."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    filled = 0
    for chunk in chunks:
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return buffer, view
