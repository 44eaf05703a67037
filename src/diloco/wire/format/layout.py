"""Where each tensor sits in a safetensors body, and bodies that outlive one response.

`FrameLayout` is the byte plan `encode_tensors` writes: the 8-byte header length, the JSON
header padded to 8 bytes, then every tensor in its slot, widest dtype first so that each slot
is aligned to its element size. `FrameBuffer` is one body of a layout in memory, with tensor
views of its slots, so a server can compute straight into the bytes it will send, and can
lend read-only views of those bytes to any number of responses while knowing whether any of
them is still alive (a buffer is only written again once none is).
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from diloco.wire.format.dtypes import safetensors_code


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor's place in a body: dtype, shape, and its byte range from the body's start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class FrameLayout:
    """The header bytes and the slot of every tensor of one safetensors body."""

    header: bytes  # the 8-byte little-endian length, then the JSON header padded to 8 bytes
    slots: dict[str, Slot]
    size: int  # bytes in the whole body

    @classmethod
    def plan(
        cls,
        entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        metadata: Mapping[str, str] | None = None,
    ) -> FrameLayout:
        """The layout of `entries` (name -> (shape, dtype)), widest dtype first (a stable sort),
        with `metadata` (strings to strings) as the header's `__metadata__` when given.

        Raises ValueError for a dtype the wire does not carry.
        """
        order = sorted(entries.items(), key=lambda item: -item[1][1].itemsize)
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for name, (shape, dtype) in order:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": safetensors_code(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        data_start = 8 + len(raw)
        slots = {
            name: Slot(
                dtype,
                tuple(shape),
                data_start + header[name]["data_offsets"][0],
                math.prod(shape) * dtype.itemsize,
            )
            for name, (shape, dtype) in order
        }
        return cls(len(raw).to_bytes(8, "little") + raw, slots, data_start + offset)

    @classmethod
    def of(
        cls,
        tensors: Mapping[str, torch.Tensor],
        float_dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> FrameLayout:
        """The layout `encode_tensors(tensors, float_dtype, metadata)` writes."""
        entries = {}
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
            dtype = tensor.dtype
            if float_dtype is not None and tensor.is_floating_point():
                dtype = float_dtype
            entries[name] = (tuple(tensor.shape), dtype)
        return cls.plan(entries, metadata=metadata)

    def views(self, body: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensor views of every slot of `body` (a 1-D uint8 tensor of `size` bytes)."""
        if body.dtype != torch.uint8 or body.dim() != 1 or body.numel() != self.size:
            raise ValueError(f"a body of this layout is a 1-D uint8 tensor of {self.size} bytes")
        views = {}
        for name, slot in self.slots.items():
            if slot.nbytes == 0:
                views[name] = torch.empty(slot.shape, dtype=slot.dtype)
            else:
                raw = body[slot.start : slot.start + slot.nbytes]
                views[name] = raw.view(slot.dtype).view(slot.shape)
        return views

    def write_header(self, body: torch.Tensor) -> None:
        """Write the header bytes at the start of `body` (a 1-D uint8 tensor)."""
        body[: len(self.header)].copy_(torch.frombuffer(bytearray(self.header), dtype=torch.uint8))


class Loans:
    """Read-only views lent out of one writable buffer, each counted until it (and every view
    made from it) is gone: the buffer is written again only once `lent` is False.

    Each view's exporter is a numpy array made for that loan alone: every view derived from
    the memoryview keeps that array alive, so the loan ends exactly when the last derived view
    is released (by a finished response, or by a transport that sent it).
    """

    def __init__(self) -> None:
        self._loans: list[weakref.ref[numpy.ndarray]] = []

    def lend(self, exporter: numpy.ndarray) -> memoryview:
        """A read-only memoryview of `exporter` (a new array over the buffer), counted."""
        exporter.flags.writeable = False
        self._loans = [*self._live(), weakref.ref(exporter)]
        return memoryview(exporter)

    @property
    def lent(self) -> bool:
        self._loans = self._live()
        return bool(self._loans)

    def _live(self) -> list[weakref.ref[numpy.ndarray]]:
        return [loan for loan in self._loans if loan() is not None]


class FrameBuffer:
    """One body of `layout` in memory; `views` write into it, `lend()` reads it out.

    The memory is not zeroed: a new buffer holds the header and garbage until its slots are
    written. Each `lend()` returns a read-only memoryview, counted (`Loans`) until that view,
    and every view made from it, is gone; `lent` says whether any is still alive.
    """

    def __init__(self, layout: FrameLayout) -> None:
        self.layout = layout
        self._body = torch.empty(layout.size, dtype=torch.uint8)
        layout.write_header(self._body)
        self.views = layout.views(self._body)
        self._loans = Loans()

    @property
    def nbytes(self) -> int:
        return self.layout.size

    def fill(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy (and cast) every tensor of the layout into its slot."""
        for name, view in self.views.items():
            if view.numel():
                view.copy_(tensors[name].detach())

    def lend(self) -> memoryview:
        """A read-only view of the whole body; `lent` is True until it (and its slices) are gone."""
        return self._loans.lend(self._body.numpy())

    @property
    def lent(self) -> bool:
        return self._loans.lent


class LentBytes:
    """A body held as bytes (a step's coded delta), lent out like a `FrameBuffer`'s: whoever
    would write over `data` asks `lent` first."""

    def __init__(self, data: bytearray) -> None:
        self.data = data
        self._loans = Loans()

    def lend(self) -> memoryview:
        """A read-only view of the bytes; `lent` is True until it (and its slices) are gone."""
        return self._loans.lend(numpy.frombuffer(self.data, dtype=numpy.uint8))

    @property
    def lent(self) -> bool:
        return self._loans.lent
