"""A compressed body read back as decoded fp32 pieces, span by span: never decoded whole.

A server folds a compressed pseudo-gradient as it folds a spooled plain one (a `PieceBody`),
a piece at a time, from its spool file or from the request's buffer. A piece is one span of
one tensor (`Layout.spans`, 2 MiB of fp32 on CPU): the span's byte ranges of the tensor's
parts are read (one pread each from a file), checked by `read_span` (scales, levels, values,
indices, padding bits: 422 malformed_compressed naming the tensor and the part) and decoded
into one reused fp32 buffer. A top-k tensor is read in larger spans (`codecs.read_elements`:
as many kept values as a piece holds values) and, for a fold that asks, handed on as its kept
values (`SparsePiece`), not decoded into a span of zeros. So:
- memory is a few MiB per upload, whatever the model's size (no model-sized temporary);
- the first contribution of a round can be checked while it is folded, in one read, and a
  refusal half way changes nothing, exactly as for a plain spooled body;
- the bound that keeps the round's fp32 sums finite (sum_overflow) comes from the span's
  scales (`codecs.max_abs`), with no extra pass over the decoded values.
Tensors sent exact (buffers, frozen tensors) are plain entries, read like a plain body's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator

import torch

from diloco.algorithm.compression.codecs import (
    Span,
    decode,
    decode_sparse,
    max_abs,
    piece_elements,
    read_elements,
)
from diloco.algorithm.tensors import finite_bound
from diloco.wire.compressed.header import CompressedEntry, CompressedHeader
from diloco.wire.compressed.values import as_bytes, read_span
from diloco.wire.format.spool import Piece, PieceBody, SpooledTensors

Bytes = torch.Tensor | memoryview


class CompressedPieces(PieceBody):
    """The decoded pieces of a compressed body whose header passed `check_compressed_header`.

    Build it with `spooled` (the parts are header entries of a file) or `in_memory` (the parts
    are tensors viewing the request's buffer). Nothing is read before `pieces()`.
    """

    def __init__(self, header: CompressedHeader, source: SpooledTensors | None) -> None:
        self.header = header
        self.source = source
        self.largest: str | None = None
        self._scratch: dict[str, bytearray] = {}  # one read buffer per part, reused
        self._out = torch.empty(0, dtype=torch.float32)  # one decoded span, reused

    @classmethod
    def spooled(cls, header: CompressedHeader, spooled: SpooledTensors) -> CompressedPieces:
        """`header` checked on `spooled.entries`; the file is read span by span."""
        return cls(header, spooled)

    @classmethod
    def in_memory(cls, header: CompressedHeader) -> CompressedPieces:
        """`header` checked on the tensors of a body in memory (views of its buffer)."""
        return cls(header, None)

    @property
    def nbytes(self) -> int:
        if self.source is not None:
            return self.source.nbytes
        entries = [*self.header.plain.values()]
        entries += [part for e in self.header.compressed.values() for part in e.parts.values()]
        return sum(math.prod(entry.shape) * entry.dtype.itemsize for entry in entries)

    @property
    def meta(self) -> dict[str, torch.Tensor]:
        """Compressed tensors as fp32 of their shape (what they decode to), plain ones as
        sent."""
        shapes = {
            name: torch.empty(e.shape, dtype=torch.float32, device="meta")
            for name, e in self.header.compressed.items()
        }
        for name, entry in self.header.plain.items():
            shapes[name] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        return shapes

    def bounded_pieces(
        self, sparse: bool = False
    ) -> Iterator[tuple[str, int, Piece, float | None]]:
        """Plain entries first (bounded by a scan of their values), then each compressed
        tensor span by span (bounded by `max_abs`, its values being checked finite).
        `sparse`: a top-k span comes as a `SparsePiece` (its kept values, not decoded into a
        span of zeros), from spans of `read_elements`."""
        return self._bounded(decoded=True, sparse=sparse)

    def bounds(self) -> Iterator[tuple[str, int, torch.Tensor, float | None]]:
        """The coded spans checked without being decoded (each comes as an empty tensor):
        `read_span` checks their levels, scales and indices, and `max_abs` bounds them from
        the scales, so the fold decodes each value once (an int8 scan that decoded every
        value cost as much as the fold itself)."""
        return self._bounded(decoded=False, sparse=False)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, decoded whole into a new fp32 tensor of its shape: robust aggregation
        reads a tensor of every held body at a time, never a whole body."""
        shape = self.meta[name].shape
        out = torch.empty(shape.numel(), dtype=torch.float32)
        for _, first, piece, _ in self._bounded(decoded=True, sparse=False, names={name}):
            assert isinstance(piece, torch.Tensor)
            out[first : first + piece.numel()].copy_(piece)
        return out.view(shape)

    def _bounded(
        self, decoded: bool, sparse: bool, names: Collection[str] | None = None
    ) -> Iterator[tuple[str, int, Piece, float | None]]:
        """`bounded_pieces`; with `decoded` False a coded span comes as an empty tensor.
        `names`: only these tensors' pieces."""
        plain = [n for n in self.header.plain if names is None or n in names]
        if self.source is not None:
            if self.source.closed:
                raise ValueError("the spooled body was closed")
            if plain:
                for name, first, piece in self.source.pieces(names=plain):
                    yield name, first, piece, finite_bound(piece)
        else:
            for name in plain:
                flat = self.header.plain[name].reshape(-1)
                yield name, 0, flat, finite_bound(flat)
        cpu = torch.device("cpu")
        for name, entry in self.header.compressed.items():
            if names is not None and name not in names:
                continue
            codec = entry.layout.codec
            # a top-k span's checks, or its kept values, cost per span (read_elements), where
            # a span decoded whole is a span of fp32
            large = codec.is_sparse and (sparse or not decoded)
            size = read_elements(codec, cpu) if large else piece_elements(cpu)
            for span in entry.layout.spans(size):
                encoded = read_span(entry, span, self._span_parts(entry, span))
                bound = max_abs(encoded, codec)
                if large and decoded:
                    yield name, span.start, decode_sparse(encoded, codec), bound
                    continue
                out = self._piece(span.numel if decoded else 0)
                if decoded:
                    decode(encoded, codec, out=out)
                yield name, span.start, out, bound

    def _span_parts(self, entry: CompressedEntry, span: Span) -> dict[str, Bytes]:
        """The span's bytes of each part: read from the file, or sliced from memory."""
        if self.source is None:
            return {
                part: as_bytes(entry.parts[part])[begin:end]
                for part, (begin, end) in entry.part_ranges(span).items()
            }
        parts: dict[str, Bytes] = {}
        for part, (begin, end) in entry.data_ranges(span).items():
            view = self._buffer(part, end - begin)
            self.source.read_into(begin, view)
            parts[part] = view
        return parts

    def _buffer(self, part: str, nbytes: int) -> memoryview:
        """`nbytes` of the part's read buffer; a larger one replaces it (never resized in
        place: the last span's tensors may still view it)."""
        buffer = self._scratch.get(part)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._scratch[part] = bytearray(nbytes)
        return memoryview(buffer)[:nbytes]

    def _piece(self, numel: int) -> torch.Tensor:
        if self._out.numel() < numel:
            self._out = torch.empty(numel, dtype=torch.float32)
        return self._out[:numel]

    def close(self) -> None:
        """The file goes back with its spooled body (whoever closes that first). Idempotent."""
        if self.source is not None:
            self.source.close()

    def hold(self) -> None:
        if self.source is not None:
            self.source.hold()

    def release(self) -> None:
        if self.source is not None:
            self.source.release()
