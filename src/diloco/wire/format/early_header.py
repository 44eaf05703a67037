"""A tensor body's safetensors header, checked as soon as it has arrived.

The first 8 bytes of a safetensors body give the header's length and the JSON header follows:
once those bytes are in, the names, shapes, dtypes and the `__metadata__` (a compressed body's
codec) are known, so a body that will be refused for its layout (a wrong shape in a 1 GiB
upload, a part of the wrong length, another codec) is refused before the rest is read or
spooled.
The header is parsed in a worker thread: a large one (100k tensors) takes seconds, which must
not stall the event loop that receives every other upload and heartbeat. It still holds the
GIL while it parses (about a second for 18 MB of JSON), and its Python objects take about
ten times its bytes of memory; so where the receiver knows the most a body of its model can
need (`max_header`), a header whose length says it is longer is refused from those 8 bytes,
before any of it is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import anyio.to_thread
import torch

from diloco.wire.errors import WireError
from diloco.wire.format.frames import MAX_HEADER_BYTES, _Entry, read_frame_header

# Called with shape-and-dtype stand-ins (meta tensors) of the header's entries and the header's
# `__metadata__` ({} without one); raises to refuse.
HeaderCheck = Callable[[Mapping[str, torch.Tensor], Mapping[str, str]], None]
# Where the data section starts, the checked entries, the metadata.
Header = tuple[int, dict[str, _Entry], dict[str, str]]


class HeaderPrefix:
    """A body's first bytes, collected from its chunks until its header is whole."""

    def __init__(self, total: int, max_header: int | None = None) -> None:
        self.total = total
        self.max_header = max_header
        self.bytes = bytearray()
        self.needed = 8  # the length first; then 8 + the header's length
        self.whole = False

    def feed(self, chunk: bytes | bytearray | memoryview) -> bool:
        """Take from `chunk` what the header lacks; True once it is whole, or once its length
        already shows that it cannot be (the parse then says why). WireError 413
        header_too_large when a length the body could hold is over `max_header`."""
        view = memoryview(chunk)
        taken = 0
        while not self.whole and taken < len(view):
            step = min(self.needed - len(self.bytes), len(view) - taken)
            self.bytes += view[taken : taken + step]
            taken += step
            if len(self.bytes) < self.needed:
                break
            if self.needed == 8:
                header_len = int.from_bytes(self.bytes[:8], "little")
                if 0 < header_len <= min(MAX_HEADER_BYTES, self.total - 8):
                    # (a length the body cannot hold is malformed first: the parse says so)
                    if self.max_header is not None and header_len > self.max_header:
                        raise header_too_large(header_len, self.max_header)
                    self.needed = 8 + header_len
                    continue
            self.whole = True
        return self.whole


# What one tensor's entries may take in a header, beyond its name: a compressed tensor has up
# to three parts (NAME#codes, #scales, #indices), each `"NAME#part":{"dtype":"U8","shape":[...],
# "data_offsets":[A,B]}` (about 50 bytes besides the name and the numbers, which are at most 20
# digits each). Four entries of the name and 160 bytes: a body takes at most 3/4 of that
# however long its names (three entries), under half with the bundled GPT's names.
HEADER_BYTES_PER_ENTRY = 160
ENTRIES_PER_TENSOR = 4
HEADER_BASE_BYTES = 64 * 1024  # the `__metadata__` (a codec's settings) and the braces


def header_limit(names: Iterable[str]) -> int:
    """The most header bytes a body of the tensors `names` (plain or compressed by any codec)
    needs, with room to spare: a longer header is refused from its length (`max_header`).
    A name counts as JSON writes it (our writers escape non-ASCII: "é" takes 6 bytes, more
    than its UTF-8), so a writer of raw UTF-8 fits too."""
    return HEADER_BASE_BYTES + sum(
        ENTRIES_PER_TENSOR * (len(json.dumps(name)) - 2 + HEADER_BYTES_PER_ENTRY) for name in names
    )


def header_too_large(header_len: int, limit: int) -> WireError:
    """413 header_too_large: a header longer than any body of the receiver's model needs."""
    return WireError(
        413,
        "header_too_large",
        f"the body's safetensors header is {header_len} bytes, over the {limit} bytes that "
        "any body of this model needs (refused from its length, before reading it)",
        header_bytes=header_len,
        limit=limit,
    )


def meta_tensors(entries: Mapping[str, _Entry]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins (no storage) of a header's entries."""
    return {
        name: torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        for name, entry in entries.items()
    }


def _parse(prefix: bytes | bytearray, total: int, check: HeaderCheck | None) -> Header:
    header = read_frame_header(prefix, total)
    if check is not None:
        check(meta_tensors(header[1]), header[2])
    return header


class EarlyHeader:
    """Watches a body's chunks as they arrive: once its header is whole, parses it (WireError
    422 when malformed) and runs `check` on it, in a worker thread; `header` is then the result.
    Costs one attribute test per chunk after that. `max_header`: see the module's docstring."""

    def __init__(
        self, total: int, check: HeaderCheck | None = None, max_header: int | None = None
    ) -> None:
        self.prefix = HeaderPrefix(total, max_header)
        self.check = check
        self.header: Header | None = None
        self.done = False

    async def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.prefix.feed(chunk):
            await self.finish()

    async def finish(self) -> Header:
        """The checked header, parsed now if it was not yet (a body too short for a header
        is refused here)."""
        if self.header is None:
            prefix = self.prefix
            self.header = await anyio.to_thread.run_sync(
                _parse, prefix.bytes, prefix.total, self.check
            )
            self.done = True
        return self.header
