"""Tensor bodies parked on disk, so the server's memory does not grow with concurrent uploads.

The server keeps at most a few bodies in RAM; any other upload is written to an unlinked
temporary file as it arrives and read back a few MiB at a time, first to check every value
(NaN/Inf, bool bytes) and then to fold it into the round's running sum. Names, shapes and dtypes
come from the header, so they are checked before any value is read.

The files are kept for the next uploads (`SpoolFiles`): writing over a file's cached pages
costs half of what filling a new file does, and closing a file of 100 MB frees its page cache
synchronously (about 15 ms, on the event loop) every time.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator
from typing import BinaryIO, Protocol

import anyio.to_thread
import torch

from diloco.algorithm.tensors import SparsePiece, finite_bound
from diloco.wire.errors import WireError
from diloco.wire.format.body import check_length
from diloco.wire.format.early_header import EarlyHeader, HeaderCheck, meta_tensors
from diloco.wire.format.frames import MAX_HEADER_BYTES, _Entry, _malformed, read_frame_header

PIECE_BYTES = 2 * 1024 * 1024
Piece = torch.Tensor | SparsePiece  # a span of a tensor, dense or as its kept values
SPOOL_FILES_KEPT = 4


class SpoolFollower(Protocol):
    """A reader of a spool file while its body arrives (a server's copy of the body into its
    state dir, written as the bytes come instead of after the last): told how many bytes the
    file holds so far, and how the body ended; released with the body."""

    def written(self, nbytes: int) -> None:
        """The file now holds the body's first `nbytes` bytes."""

    def ended(self, complete: bool) -> None:
        """The body is whole, or (`complete` False) never will be: then the follower has
        stopped reading the file when this returns."""

    def release(self) -> None:
        """The body is done with (its file goes back for the next upload): the follower has
        stopped reading it when this returns."""


# (the spool file's descriptor, the body's data bytes, its bytes in all) -> a follower, or
# None; called once the header is checked, in a worker thread
FollowSpool = Callable[[int, int, int], SpoolFollower | None]


class SpoolFiles:
    """Unlinked temporary files in `directory`, up to `keep` of them kept between uploads.

    A kept file holds the bytes of its largest upload on disk and in the page cache (which the
    kernel may reclaim once they are written back), so what is kept is bounded by `keep` times
    the body size limit.
    """

    def __init__(self, directory: str | None = None, keep: int = SPOOL_FILES_KEPT) -> None:
        self.directory = directory
        self.keep = keep
        self._idle: list[BinaryIO] = []
        self._lock = threading.Lock()

    def take(self) -> BinaryIO:
        with self._lock:
            file = self._idle.pop() if self._idle else None
        if file is None:
            return tempfile.TemporaryFile(dir=self.directory)
        file.seek(0)
        return file

    def give_back(self, file: BinaryIO) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(file)
                return
        file.close()

    @property
    def idle(self) -> int:
        return len(self._idle)


class PieceBody:
    """A tensor body the server reads a piece at a time, in bounded memory, never whole: a
    spooled file (`SpooledTensors`) or a compressed body decoded span by span
    (wire/compressed/pieces.py). The intake and the fold use only this interface, so every
    such body is scanned, checked and folded the same way.
    """

    largest: str | None = None  # after check_values: the tensor of the largest value

    @property
    def nbytes(self) -> int:
        """Bytes of its data section (what it brought over the network, less the header)."""
        raise NotImplementedError

    @property
    def meta(self) -> dict[str, torch.Tensor]:
        """Shape-and-dtype stand-ins (no storage) of the tensors its pieces cover."""
        raise NotImplementedError

    def pieces(self, sparse: bool = False) -> Iterator[tuple[str, int, Piece]]:
        """(name, first element, 1-D piece) covering every tensor of `meta` once. A piece is
        only valid until the next one is read: use it, don't keep it. `sparse`: a span a
        body holds as kept values (top-k) may come as a `SparsePiece`, for a reader that adds
        them (RunningMean.add_pieces); every other piece is a tensor."""
        for name, first, piece, _ in self.bounded_pieces(sparse):
            yield name, first, piece

    def bounded_pieces(
        self, sparse: bool = False
    ) -> Iterator[tuple[str, int, Piece, float | None]]:
        """`pieces(sparse)`, each with a bound of its magnitudes (None: it holds NaN or
        Inf)."""
        for name, first, piece in self.pieces():
            yield name, first, piece, finite_bound(piece)

    def checked_pieces(self, limit: float | None = None) -> CheckedPieces:
        """`pieces()`, each checked (NaN/Inf: WireError 422) before it is handed on; once they
        are all read, `.bound` bounds every value's magnitude. For a reader that checks and
        folds in one read of the file, where a refusal half way costs nothing. `limit`: the
        largest magnitude allowed (see CheckedPieces)."""
        return CheckedPieces(self, limit)

    def check_values(self) -> float:
        """WireError(422) for a value that is refused (NaN or Inf anywhere, a bool byte that
        is not 0 or 1, a malformed compressed part).

        Returns an upper bound of every value's magnitude, found in the same pass, so that a
        running sum of checked bodies can be known finite; `largest` then names the tensor
        that sets it.
        """
        checked = CheckedPieces(self, bounded=self.bounds())
        for _ in checked:
            pass
        self.largest = checked.largest
        return checked.bound

    def bounds(self) -> Iterator[tuple[str, int, torch.Tensor, float | None]]:
        """What `check_values` checks: `bounded_pieces()`, unless a body can bound its
        values without producing them (a compressed body: from its scales)."""
        return self.bounded_pieces()

    def close(self) -> None:
        """Done with the body. Idempotent."""

    def hold(self) -> None:
        """Someone keeps the body past the request that brought it (a round that folds it
        when it commits): `close()` then leaves it open, and `release()` closes it."""

    def release(self) -> None:
        """The holder is done: close the body for good."""
        self.close()


class SpooledTensors(PieceBody):
    """A safetensors body in a temporary file; `pieces()` reads it back in bounded memory.

    The file may be longer than the body (a kept file from a larger upload): only the first
    `size` bytes are ever read.
    """

    def __init__(
        self,
        file: BinaryIO,
        size: int,
        data_start: int,
        entries: dict[str, _Entry],
        files: SpoolFiles,
        metadata: dict[str, str] | None = None,
    ):
        self.file = file
        self.size = size
        self.data_start = data_start
        self.entries = entries
        self.metadata = dict(metadata or {})  # the header's __metadata__ (a codec's, say)
        self._files = files
        self.closed = False
        self.held = False  # see hold()
        self.largest: str | None = None
        self.follower: SpoolFollower | None = None  # see spool_body's `follow`

    @property
    def nbytes(self) -> int:
        return self.size - self.data_start

    @property
    def meta(self) -> dict[str, torch.Tensor]:
        return meta_tensors(self.entries)

    def pieces(
        self,
        sparse: bool = False,
        *,
        piece_bytes: int = PIECE_BYTES,
        names: Collection[str] | None = None,
    ) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, first element, 1-D piece) in file order, read into one reused buffer; only
        the entries in `names` when given. (Every piece is dense: `sparse` changes nothing.)

        A piece is only valid until the next one is read: use it, don't keep it.
        """
        if self.closed:
            raise ValueError("the spooled body was closed")
        buffer = bytearray(piece_bytes)
        view = memoryview(buffer)
        descriptor = self.file.fileno()
        chosen = self.entries.values() if names is None else (self.entries[n] for n in names)
        for entry in sorted(chosen, key=lambda e: e.begin):
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

    def read_into(self, begin: int, view: memoryview) -> None:
        """Fill `view` with the data section's bytes from `begin` on (a compressed part's span,
        say)."""
        if self.closed:
            raise ValueError("the spooled body was closed")
        if not len(view):
            return
        if os.preadv(self.file.fileno(), [view], self.data_start + begin) != len(view):
            raise OSError(f"spool file ended early (bytes {begin}+ of the data section)")

    def close(self) -> None:
        """Done with the body: its file goes back to its `SpoolFiles` (unless it is held).
        Idempotent."""
        if self.closed or self.held:
            return
        self.closed = True
        if self.follower is not None:  # done reading the file before it goes back
            self.follower.release()
        self._files.give_back(self.file)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        self.close()


def open_spooled(path: str | os.PathLike[str]) -> SpooledTensors:
    """A body file on disk (a follower's held slice, a logged step's input) opened as an
    upload's spooled body: header checked, values read a piece at a time; `close()` closes
    the file (WireError when its header is not a body's)."""
    file = open(path, "rb")  # noqa: SIM115 - closed by the body's close()
    try:
        size = os.fstat(file.fileno()).st_size
        header_len = int.from_bytes(os.pread(file.fileno(), 8, 0), "little")
        prefix = os.pread(file.fileno(), 8 + min(header_len, MAX_HEADER_BYTES), 0)
        data_start, entries, metadata = read_frame_header(prefix, size)
    except BaseException:
        file.close()
        raise
    return SpooledTensors(file, size, data_start, entries, SpoolFiles(keep=0), metadata)


class CheckedPieces:
    """The pieces of a body, each scanned before it is yielded (see checked_pieces).

    `largest` names the tensor whose piece set `bound`. With `limit`, a piece whose values
    may exceed it is refused (422 sum_overflow): folded, it could overflow the round's sum.
    """

    def __init__(
        self,
        spooled: PieceBody,
        limit: float | None = None,
        bounded: Iterable[tuple[str, int, torch.Tensor, float | None]] | None = None,
    ) -> None:
        """`bounded`: the (name, first, piece, bound) to check, when not the body's own
        `bounded_pieces()` (a compressed body's check without decoding)."""
        self.spooled = spooled
        self.bound = 0.0
        self.largest: str | None = None
        self.limit = limit
        self.sparse = False  # top-k spans as SparsePiece (see PieceBody.pieces), for a fold
        self._bounded = bounded

    def __iter__(self) -> Iterator[tuple[str, int, Piece]]:
        bounded = self._bounded
        if bounded is None:
            bounded = self.spooled.bounded_pieces(self.sparse)
        for name, first, piece, piece_bound in bounded:
            if piece_bound is None:
                values = piece.values if isinstance(piece, SparsePiece) else piece
                bad = int((~torch.isfinite(values)).sum())
                raise WireError(
                    422,
                    "non_finite",
                    f"tensor {name!r} holds NaN or Inf values ({bad} in elements {first} to "
                    f"{first + piece.numel() - 1})",
                    tensor=name,
                    count=bad,
                )
            if piece_bound > self.bound or self.largest is None:
                self.bound, self.largest = max(self.bound, piece_bound), name
            if self.limit is not None and piece_bound > self.limit:
                raise sum_overflow(name, piece_bound, self.limit)
            yield name, first, piece


def sum_overflow(name: str, bound: float, limit: float) -> WireError:
    """422 for values that, weighted and added to a round's fp32 sum, could overflow it."""
    return WireError(
        422,
        "sum_overflow",
        f"tensor {name!r} holds values up to {bound:.3g}; weighted and added to the round's "
        f"fp32 sum they could overflow it (at most {max(limit, 0.0):.3g} fits now)",
        tensor=name,
        bound=bound,
        limit=max(limit, 0.0),
    )


async def spool_body(
    chunks: AsyncIterator[bytes],
    content_length: int | None,
    max_bytes: int,
    directory: str | None = None,
    files: SpoolFiles | None = None,
    check_header: HeaderCheck | None = None,
    follow: FollowSpool | None = None,
    max_header: int | None = None,
) -> SpooledTensors:
    """Write exactly `content_length` bytes to an unlinked temporary file and parse its header.

    Same 411/413/422 rules as `read_body`. The file comes from `files` and goes back there when
    the result is closed (on a refusal too); without `files` it is a new file in `directory`,
    which disappears when the result is closed or garbage-collected. The header is parsed, and
    `check_header` run on its entries, as soon as it has arrived: a refusal then comes before
    the rest of the body is read. `follow`: asked once the header is checked for a follower
    of the file, which then hears of every chunk written (flushed first) and rides on the
    result as `follower` (released when it is closed). `max_header`: a header longer is 413
    header_too_large, from its length alone (early_header.py).
    """
    check_length(content_length, max_bytes)
    assert content_length is not None
    files = files or SpoolFiles(directory, keep=0)  # keep=0: a file is closed when given back
    file = files.take()
    early = EarlyHeader(content_length, check_header, max_header)
    follower: SpoolFollower | None = None
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
            if not early.done:
                await early.feed(chunk)
                if early.header is not None and follow is not None:
                    data_bytes = content_length - early.header[0]
                    follower = await anyio.to_thread.run_sync(
                        follow, file.fileno(), data_bytes, content_length
                    )
            if follower is not None:
                file.flush()
                follower.written(written)
        if written < content_length:
            raise WireError(
                422,
                "invalid_request",
                f"the body ended after {written} of {content_length} bytes",
                content_length=content_length,
                received=written,
            )
        file.flush()
        data_start, entries, metadata = await early.finish()
        spooled = SpooledTensors(file, content_length, data_start, entries, files, metadata)
        if follower is not None:
            follower.ended(complete=True)
            spooled.follower = follower
        return spooled
    except BaseException:
        if follower is not None:  # (it stops reading the file before the file goes back)
            follower.ended(complete=False)
            follower.release()
        files.give_back(file)
        raise
