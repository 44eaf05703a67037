"""Tensor bodies parked on disk, so the server's memory does not grow with concurrent uploads.

The server keeps at most a few bodies in RAM; any other upload is written to an unlinked
temporary file as it arrives and read back a few MiB at a time, first to check every value
(NaN/Inf, bool bytes) and then to fold it into the round's running sum. Names, shapes and dtypes
come from the header, so they are checked before any value is read.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO

import torch

from diloco.algorithm.tensors import all_finite
from diloco.wire.body import check_length
from diloco.wire.errors import WireError
from diloco.wire.frames import MAX_HEADER_BYTES, _Entry, _malformed, parse_frame_header

PIECE_BYTES = 8 * 1024 * 1024


class SpooledTensors:
    """A safetensors body in a temporary file; `pieces()` reads it back in bounded memory."""

    def __init__(self, file: BinaryIO, size: int, data_start: int, entries: dict[str, _Entry]):
        self.file = file
        self.size = size
        self.data_start = data_start
        self.entries = entries

    @property
    def nbytes(self) -> int:
        return self.size - self.data_start

    @property
    def meta(self) -> dict[str, torch.Tensor]:
        """Shape-and-dtype stand-ins (no storage), for the checks that need no values."""
        return {
            name: torch.empty(entry.shape, dtype=entry.dtype, device="meta")
            for name, entry in self.entries.items()
        }

    def pieces(self, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, first element, 1-D piece) in file order, read into one reused buffer.

        A piece is only valid until the next one is read: use it, don't keep it.
        """
        buffer = bytearray(piece_bytes)
        view = memoryview(buffer)
        descriptor = self.file.fileno()
        for entry in sorted(self.entries.values(), key=lambda e: e.begin):
            itemsize = entry.dtype.itemsize
            numel = math.prod(entry.shape)
            step = max(1, piece_bytes // itemsize)
            for first in range(0, numel, step):
                count = min(step, numel - first)
                nbytes = count * itemsize
                offset = self.data_start + entry.begin + first * itemsize
                got = os.preadv(descriptor, [view[:nbytes]], offset)
                if got != nbytes:
                    raise OSError(f"spool file ended early at tensor {entry.name!r}")
                piece = torch.frombuffer(buffer, dtype=entry.dtype, count=count)
                if entry.dtype == torch.bool and bool((piece.view(torch.uint8) > 1).any()):
                    raise _malformed(
                        f"tensor {entry.name!r} is bool but holds bytes other than 0 and 1",
                        tensor=entry.name,
                    )
                yield entry.name, first, piece

    def check_values(self) -> None:
        """WireError(422) for NaN or Inf anywhere, or for a bool byte that is not 0 or 1."""
        for name, first, piece in self.pieces():
            if not all_finite(piece):
                bad = int((~torch.isfinite(piece)).sum())
                raise WireError(
                    422,
                    "non_finite",
                    f"tensor {name!r} holds NaN or Inf values ({bad} in elements {first} to "
                    f"{first + piece.numel() - 1})",
                    tensor=name,
                    count=bad,
                )

    def close(self) -> None:
        self.file.close()


async def spool_body(
    chunks: AsyncIterator[bytes],
    content_length: int | None,
    max_bytes: int,
    directory: str | None = None,
) -> SpooledTensors:
    """Write exactly `content_length` bytes to an unlinked temporary file and parse its header.

    Same 411/413/422 rules as `read_body`; the file disappears when the result is closed or
    garbage-collected.
    """
    check_length(content_length, max_bytes)
    assert content_length is not None
    file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - handed to SpooledTensors
    try:
        written = 0
        async for chunk in chunks:
            if not chunk:
                continue
            written += len(chunk)
            if written > content_length:
                raise WireError(
                    422,
                    "invalid_request",
                    f"the body is longer than its Content-Length of {content_length} bytes",
                    content_length=content_length,
                    received_at_least=written,
                )
            file.write(chunk)
        if written < content_length:
            raise WireError(
                422,
                "invalid_request",
                f"the body ended after {written} of {content_length} bytes",
                content_length=content_length,
                received=written,
            )
        file.flush()
        prefix = os.pread(file.fileno(), 8, 0)
        if len(prefix) == 8:  # read only the header, never the data section
            header_len = min(int.from_bytes(prefix, "little"), MAX_HEADER_BYTES, content_length)
            prefix += os.pread(file.fileno(), header_len, 8)
        data_start, entries = parse_frame_header(prefix, content_length)
        return SpooledTensors(file, content_length, data_start, entries)
    except BaseException:
        file.close()
        raise
