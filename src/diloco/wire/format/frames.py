"""Tensor frames: safetensors bytes out, and a strict zero-copy safetensors parser in.

Encoding uses the safetensors library. Decoding is our own because bodies come from the network:
every header field is checked before a tensor is made, and tensors are views of the request
buffer, so a 100 MB body costs no copy and no per-element Python work.

`check_tensors`, `read_body` and `parse_content_length` live in their own modules and are
re-exported here, so that everything about a tensor body can be imported from `wire.frames`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco.wire.errors import WireError
from diloco.wire.format.body import parse_content_length, read_body
from diloco.wire.format.checks import check_tensors
from diloco.wire.format.dtypes import SAFETENSORS_CODES, dtype_from_safetensors_code
from diloco.wire.format.layout import FrameLayout

__all__ = [
    "MAX_HEADER_BYTES",
    "check_tensors",
    "decode_frame",
    "decode_tensors",
    "encode_tensors",
    "parse_content_length",
    "read_body",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024
_METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
    float_dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytearray:
    """Safetensors bytes of `tensors`; floating ones cast to `float_dtype` when it is given,
    and `metadata` as the header's `__metadata__` (a compressed body's codec, when its parts
    are written as they are).

    Written by hand into one preallocated buffer: each tensor is copied (and cast, in the same
    pass) straight into its slot, which is about twice as fast as building the file with the
    safetensors library and needs no intermediate cast copy. Entries go widest dtype first, so
    every tensor's offset stays aligned to its element size (readers then get zero-copy views).
    Int and bool tensors keep their dtype; tied weights are simply written twice.
    """
    layout = FrameLayout.of(tensors, float_dtype, metadata)
    buffer = bytearray(layout.size)
    body = torch.frombuffer(buffer, dtype=torch.uint8)
    layout.write_header(body)
    for name, view in layout.views(body).items():
        if view.numel():
            view.copy_(tensors[name].detach())
    return buffer


def decode_tensors(buffer: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Parse a safetensors body into tensors that are views of `buffer` (no copy).

    A writable bytearray or memoryview is shared: the tensors alias it and keep it alive. Bytes
    (immutable) are copied once into a bytearray first. Anything that is not a well-formed
    safetensors file is WireError(422, "malformed_safetensors") naming the problem.
    """
    return decode_frame(buffer)[0]


def decode_frame(
    buffer: bytes | bytearray | memoryview,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`decode_tensors`, and the header's `__metadata__` beside the tensors ({} without one)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        view = memoryview(bytearray(view.tobytes()))
    elif view.readonly:
        # torch.frombuffer warns on read-only memory; one copy makes the views safe to share.
        view = memoryview(bytearray(view))
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    data_start, entries, metadata = read_frame_header(view, len(view))
    tensors = {name: _view_tensor(view, data_start, entry) for name, entry in entries.items()}
    return tensors, metadata


def parse_frame_header(prefix: memoryview | bytes, total: int) -> tuple[int, dict[str, _Entry]]:
    """Check a safetensors header against a file of `total` bytes; `prefix` starts the file.

    Returns where the data section starts and the checked entries. `prefix` must hold at least
    the 8-byte length and the header (the whole body, or its first bytes when it is on disk).
    """
    data_start, entries, _ = read_frame_header(prefix, total)
    return data_start, entries


def read_frame_header(
    prefix: memoryview | bytes, total: int
) -> tuple[int, dict[str, _Entry], dict[str, str]]:
    """`parse_frame_header`, and the header's checked `__metadata__` ({} without one)."""
    if total < 8 or len(prefix) < 8:
        raise _malformed(f"the body has {total} bytes, fewer than the 8-byte header length")
    header_len = int.from_bytes(prefix[:8], "little")
    if header_len == 0:
        raise _malformed("the header length is 0")
    if header_len > MAX_HEADER_BYTES:
        raise _malformed(
            f"the header length {header_len} is over the limit of {MAX_HEADER_BYTES} bytes"
        )
    if header_len > total - 8:
        raise _malformed(
            f"the header length {header_len} is more than the {total - 8} bytes after it"
        )
    header = _parse_header(bytes(prefix[8 : 8 + header_len]))
    data_start = 8 + header_len
    entries, metadata = _check_entries(header, data_len=total - data_start)
    return data_start, entries, metadata


@dataclass(frozen=True, slots=True)
class _Entry:
    """One checked header entry: its dtype, shape and byte range inside the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(raw: bytes) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise _malformed("the header does not start with '{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed(f"the header is not valid UTF-8 (byte {exc.start})") from None
    try:
        header = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants
        )
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, WireError):
            raise
        raise _malformed(f"the header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _malformed("the header is not a JSON object")
    return header


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _malformed(f"the header names {key!r} twice", tensor=key)
        result[key] = value
    return result


def _no_constants(token: str) -> Any:
    raise _malformed(f"the header holds the non-JSON constant {token}")


def _check_entries(
    header: dict[str, Any], data_len: int
) -> tuple[dict[str, _Entry], dict[str, str]]:
    entries: dict[str, _Entry] = {}
    metadata: dict[str, str] = {}
    for name, value in header.items():
        if name == _METADATA_KEY:
            metadata = _check_metadata(value)
        else:
            entries[name] = _check_entry(name, value, data_len)
    _check_coverage(entries, data_len)
    return entries, metadata


def _check_metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _malformed("the header's __metadata__ is not an object of strings to strings")
    return value


def _check_entry(name: str, value: object, data_len: int) -> _Entry:
    if not isinstance(value, dict) or set(value) != _ENTRY_FIELDS:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise _malformed(
            f"tensor {name!r} must have exactly the fields dtype, shape, data_offsets; got {got}",
            tensor=name,
        )
    code = value["dtype"]
    dtype = dtype_from_safetensors_code(code) if isinstance(code, str) else None
    if dtype is None:
        raise _malformed(
            f"tensor {name!r} has dtype {code!r}; allowed: {', '.join(SAFETENSORS_CODES)}",
            tensor=name,
        )
    shape = value["shape"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _malformed(
            f"tensor {name!r} has shape {_show(shape)}, expected a list of integers >= 0",
            tensor=name,
        )
    offsets = value["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _malformed(
            f"tensor {name!r} has data_offsets {_show(offsets)}, "
            "expected [begin, end] integers >= 0",
            tensor=name,
        )
    begin, end = offsets
    if not begin <= end <= data_len:
        raise _malformed(
            f"tensor {name!r} has data_offsets [{begin}, {end}], outside the "
            f"{data_len}-byte data section",
            tensor=name,
        )
    expected_bytes = math.prod(shape) * dtype.itemsize
    if end - begin != expected_bytes:
        raise _malformed(
            f"tensor {name!r} spans {end - begin} bytes, its shape {shape} of {code} needs "
            f"{expected_bytes}",
            tensor=name,
        )
    return _Entry(name, dtype, tuple(shape), begin, end)


def _show(value: object, limit: int = 60) -> str:
    """A JSON value as the sender wrote it, shortened for an error sentence."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_coverage(entries: Mapping[str, _Entry], data_len: int) -> None:
    """The regions must tile the data section: no overlap, no hole, nothing after the last."""
    cursor = 0
    previous: str | None = None
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < cursor:
            raise _malformed(
                f"tensor {entry.name!r} (bytes {entry.begin}-{entry.end}) overlaps "
                f"tensor {previous!r}",
                tensor=entry.name,
            )
        if entry.begin > cursor:
            raise _malformed(
                f"the data section has a gap at bytes {cursor}-{entry.begin}, "
                f"before tensor {entry.name!r}",
                tensor=entry.name,
            )
        cursor = entry.end
        previous = entry.name
    if cursor != data_len:
        raise _malformed(
            f"the data section has {data_len - cursor} bytes after the last tensor "
            f"that no tensor covers"
        )


def _view_tensor(view: memoryview, data_start: int, entry: _Entry) -> torch.Tensor:
    numel = math.prod(entry.shape)
    if numel == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    offset = data_start + entry.begin
    flat = torch.frombuffer(view, dtype=entry.dtype, count=numel, offset=offset)
    if flat.data_ptr() % entry.dtype.itemsize:
        # A misaligned region (only a hand-made file has one): copy it into aligned memory.
        aligned = bytearray(view[offset : offset + entry.end - entry.begin])
        flat = torch.frombuffer(aligned, dtype=entry.dtype)
    if entry.dtype == torch.bool and bool((flat.view(torch.uint8) > 1).any()):
        raise _malformed(
            f"tensor {entry.name!r} is bool but holds bytes other than 0 and 1",
            tensor=entry.name,
        )
    return flat.view(entry.shape)


def _malformed(error: str, **detail: Any) -> WireError:
    return WireError(422, "malformed_safetensors", error, **detail)
