"""The header of a compressed body: which entries a codec sends, and the check of a body's
entries against what the receiver expects, before any value is read.

A compressed tensor NAME travels as up to three entries (docs/protocol.md, "Compressed
bodies"): `NAME#codes`, `NAME#scales` (int codecs) and `NAME#indices` (top-k); tensors sent
exact keep their plain entry NAME; the header's `__metadata__` names the codec. The check runs
on header entries (a spooled body) or on tensors (a body in memory): only names, shapes and
dtypes are read.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco.algorithm.compression.codecs import Codec, Layout, Span
from diloco.wire.errors import WireError
from diloco.wire.format.dtypes import safetensors_code
from diloco.wire.format.specs import TensorSpec

SEPARATOR = "#"
CODES, SCALES, INDICES = "codes", "scales", "indices"
PARTS = (CODES, SCALES, INDICES)
META_CODEC = "diloco.codec"
META_BLOCK = "diloco.block"
META_CHUNK = "diloco.chunk"
META_K = "diloco.k"
_META_PREFIX = "diloco."

# Anything with a shape and a dtype: a checked header entry (wire.frames._Entry) or a tensor.
Shaped = Any
Expected = Mapping[str, "tuple[tuple[int, ...], torch.dtype] | TensorSpec"]


def codec_metadata(codec: Codec) -> dict[str, str]:
    """The `__metadata__` of a body coded by `codec` (k is 0 for a dense codec)."""
    return {
        META_CODEC: str(codec),
        META_BLOCK: str(codec.block),
        META_CHUNK: str(codec.chunk),
        META_K: str(codec.k),
    }


def part_specs(numel: int, codec: Codec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each part of a tensor of `numel` elements coded by `codec`."""
    layout = Layout(numel, codec)
    if codec.is_quantized:
        parts = {
            CODES: ((layout.codes_nbytes,), torch.uint8),
            SCALES: ((layout.blocks,), torch.float32),
        }
    else:
        dtype = torch.bfloat16 if codec.values == "bf16" else torch.float32
        parts = {CODES: ((layout.values,), dtype)}
    if codec.is_sparse:
        parts[INDICES] = ((layout.indices_nbytes,), torch.uint8)
    return parts


def is_compressed(name: str, dtype: torch.dtype, exact: Collection[str]) -> bool:
    """Floating tensors are compressed unless the caller sends them exact."""
    return dtype.is_floating_point and name not in exact


# ------------------------------------------------------------------ receiving: the header


@dataclass(frozen=True)
class CompressedEntry:
    """One compressed tensor of a checked body: its shape, layout and parts (header entries
    with byte ranges in the data section, or tensors)."""

    name: str
    shape: tuple[int, ...]
    layout: Layout
    parts: dict[str, Shaped]

    def part_ranges(self, span: Span) -> dict[str, tuple[int, int]]:
        """The span's byte range of each part, from that part's first byte."""
        ranges = {CODES: span.code_bytes}
        if SCALES in self.parts:
            ranges[SCALES] = span.scale_bytes
        if INDICES in self.parts:
            ranges[INDICES] = span.index_bytes
        return ranges

    def data_ranges(self, span: Span) -> dict[str, tuple[int, int]]:
        """`part_ranges` as offsets in the body's data section (parts that are header
        entries): a server reads each from its spool file at data_start + these."""
        return {
            part: (self.parts[part].begin + begin, self.parts[part].begin + end)
            for part, (begin, end) in self.part_ranges(span).items()
        }


@dataclass(frozen=True)
class CompressedHeader:
    """A body's entries sorted out: compressed tensors and plain ones, all as expected."""

    codec: Codec
    compressed: dict[str, CompressedEntry]
    plain: dict[str, Shaped]


def _spec(
    value: tuple[tuple[int, ...], torch.dtype] | TensorSpec,
) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(value, TensorSpec):
        return tuple(value.shape), value.dtype
    shape, dtype = value
    return tuple(shape), dtype


def malformed_compressed(error: str, **detail: Any) -> WireError:
    """422 malformed_compressed; `detail` names the tensor, the part and where."""
    return WireError(422, "malformed_compressed", error, **detail)


ECHO_KEYS, ECHO_CHARS = 8, 64  # how much of a sender's metadata an error body repeats


def echo_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The sender's diloco.* metadata as an error repeats it: a few keys, each key and value
    cut short, so that a header full of metadata does not come back as a huge answer."""
    keys = sorted(metadata)[:ECHO_KEYS]
    return {str(k)[:ECHO_CHARS]: str(metadata[k])[:ECHO_CHARS] for k in keys}


def _describe(metadata: Mapping[str, str]) -> str:
    if not metadata:
        return "no codec (the header has no diloco.* metadata)"
    if set(metadata) == {META_CODEC, META_BLOCK, META_CHUNK, META_K}:
        return (
            f"{metadata[META_CODEC]!r} (block {metadata[META_BLOCK]}, chunk "
            f"{metadata[META_CHUNK]}, k {metadata[META_K]})"
        )
    return ", ".join(f"{key}={value!r}" for key, value in sorted(metadata.items()))


def check_codec_metadata(metadata: Mapping[str, str] | None, codec: Codec) -> None:
    """422 codec_mismatch unless the body's diloco.* metadata is exactly `codec`'s."""
    want = codec_metadata(codec)
    got = {k: v for k, v in (metadata or {}).items() if k.startswith(_META_PREFIX)}
    if got != want:
        got = echo_metadata(got)
        raise WireError(
            422,
            "codec_mismatch",
            f"the body is coded as {_describe(got)}; the receiver expects {_describe(want)}",
            expected=want,
            got=got,
        )


def check_compressed_header(
    entries: Mapping[str, Shaped],
    metadata: Mapping[str, str] | None,
    expected: Expected,
    codec: Codec,
    *,
    exact: Collection[str] = frozenset(),
    require_all: bool = True,
) -> CompressedHeader:
    """Check a body's entries (header entries or tensors; only shapes and dtypes are read)
    against the tensors the receiver expects ({name: (shape, dtype)} or TensorSpecs) coded by
    its `codec`. Floating tensors not in `exact` must come as exactly their parts, with the
    dtypes and byte lengths of `part_specs`; the others as plain entries of exactly the
    expected shape and dtype. WireError 422: codec_mismatch, malformed_compressed (naming the
    tensor and the part), unknown_tensor, missing_tensor, wrong_shape, wrong_dtype."""
    check_codec_metadata(metadata, codec)
    specs = {name: _spec(value) for name, value in expected.items()}
    compressed = {n for n, (_, dtype) in specs.items() if is_compressed(n, dtype, exact)}
    groups: dict[str, dict[str, Shaped]] = {}
    plain: dict[str, Shaped] = {}
    for entry_name, entry in entries.items():
        if entry_name in specs:
            if entry_name in compressed:
                raise malformed_compressed(
                    f"tensor {entry_name!r} must be sent compressed as {codec} (entries "
                    f"{', '.join(_names(entry_name, codec))}), got a plain entry",
                    tensor=entry_name,
                )
            plain[entry_name] = entry
            continue
        base, separator, part = entry_name.rpartition(SEPARATOR)
        if not separator or base not in specs:
            raise WireError(
                422,
                "unknown_tensor",
                f"tensor {entry_name!r} is not in the model",
                tensor=entry_name,
            )
        if base not in compressed:
            raise malformed_compressed(
                f"tensor {base!r} is sent exact as a plain entry; got the compressed part "
                f"{entry_name!r}",
                tensor=base,
                part=part,
            )
        if part not in PARTS:
            raise malformed_compressed(
                f"tensor {base!r} has an unknown part {entry_name!r}; parts are {', '.join(PARTS)}",
                tensor=base,
                part=part,
            )
        groups.setdefault(base, {})[part] = entry
    if require_all:
        for name in specs:
            if name not in plain and name not in groups:
                raise WireError(
                    422,
                    "missing_tensor",
                    f"tensor {name!r} is missing from the body",
                    tensor=name,
                )
    for name, entry in plain.items():
        _check_plain(name, entry, *specs[name])
    checked = {
        name: _check_parts(name, specs[name][0], parts, codec) for name, parts in groups.items()
    }
    return CompressedHeader(codec, checked, plain)


def _names(name: str, codec: Codec) -> list[str]:
    return [f"{name}{SEPARATOR}{part}" for part in part_specs(0, codec)]


def _check_plain(name: str, entry: Shaped, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    got = list(entry.shape)
    if got != list(shape):
        raise WireError(
            422,
            "wrong_shape",
            f"tensor {name!r} has shape {got}, the model expects {list(shape)}",
            tensor=name,
            expected=list(shape),
            got=got,
        )
    if entry.dtype != dtype:
        want, have = safetensors_code(dtype), safetensors_code(entry.dtype)
        raise WireError(
            422,
            "wrong_dtype",
            f"tensor {name!r} has dtype {have}, expected {want}",
            tensor=name,
            expected=want,
            got=have,
        )


def _check_parts(
    name: str, shape: tuple[int, ...], parts: dict[str, Shaped], codec: Codec
) -> CompressedEntry:
    layout = Layout(math.prod(shape), codec)
    want = part_specs(layout.numel, codec)
    for part in want:
        if part not in parts:
            raise malformed_compressed(
                f"tensor {name!r} lacks its part {name}{SEPARATOR}{part} ({codec} sends "
                f"{', '.join(want)})",
                tensor=name,
                part=part,
            )
    for part in parts:
        if part not in want:
            raise malformed_compressed(
                f"tensor {name!r} has a part {name}{SEPARATOR}{part} that {codec} does not send",
                tensor=name,
                part=part,
            )
    for part, (part_shape, dtype) in want.items():
        entry = parts[part]
        if entry.dtype != dtype or tuple(entry.shape) != part_shape:
            got = f"{safetensors_code(entry.dtype)} {list(entry.shape)}"
            expected = f"{safetensors_code(dtype)} {list(part_shape)}"
            raise malformed_compressed(
                f"tensor {name!r} part {part!r} is {got}, expected {expected} "
                f"({_reason(part, layout)})",
                tensor=name,
                part=part,
                expected=expected,
                got=got,
            )
    return CompressedEntry(name, tuple(shape), layout, dict(parts))


def _reason(part: str, layout: Layout) -> str:
    codec = layout.codec
    what = f"{layout.values} coded values of its {layout.numel} elements"
    if codec.is_sparse:
        what += f", k = {codec.k} per chunk of {codec.chunk}"
    if part == SCALES:
        return f"one fp32 scale per block of {codec.block} of {what}"
    if part == INDICES:
        return f"{layout.values} indices at {codec.index_bits} bits, packed: {what}"
    if codec.is_quantized:
        return f"{codec.bits}-bit levels, packed: {what}"
    return what
