"""The values of a compressed body, checked and unpacked one span of one tensor at a time.

`read_span` takes a span's slices of a tensor's parts (from memory, or read from a spool file
at `CompressedEntry.data_ranges`) and returns its `Encoded` once every value is known good:
scales finite, >= 0 and small enough to decode finite; levels in range; a zero int8 / int4
scale only over zero levels; fp32 / bf16 values finite; indices below the tail chunk's length
and strictly ascending within each chunk; the padding bits after a part's last value zero.
Anything else is WireError 422 malformed_compressed naming the tensor, the part and where.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

import torch

from diloco.algorithm.compression.codecs import QMAX, Codec, Encoded, Layout, Span
from diloco.algorithm.tensors import all_finite
from diloco.wire.compressed.bitpack import padding_is_zero, unpack
from diloco.wire.compressed.header import (
    CODES,
    INDICES,
    SCALES,
    CompressedEntry,
    malformed_compressed,
)

_FP32_MAX = torch.finfo(torch.float32).max


def as_bytes(raw: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return (
            raw.reshape(-1).view(torch.uint8) if raw.numel() else torch.empty(0, dtype=torch.uint8)
        )
    if len(raw) == 0:
        return torch.empty(0, dtype=torch.uint8)
    view = memoryview(raw)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes viewed as `dtype`, copied first when they are not aligned for it."""
    if raw.numel() == 0:
        return torch.empty(0, dtype=dtype, device=raw.device)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def read_span(
    entry: CompressedEntry,
    span: Span,
    parts: Mapping[str, torch.Tensor | bytes | bytearray | memoryview],
) -> Encoded:
    """Check and unpack one span of a compressed tensor from its slices of the parts (the
    bytes of `entry.part_ranges(span)` of each). Returns the span's `Encoded` (decode it with
    algorithm.compression.codecs.decode / decode_into); WireError 422 malformed_compressed names the
    tensor, the part and the block, value or chunk that is wrong."""
    layout, name = entry.layout, entry.name
    codec = layout.codec
    count = span.values[1] - span.values[0]
    last = span.stop == layout.numel
    ranges = entry.part_ranges(span)
    raw = {part: as_bytes(parts[part]) for part in ranges}
    for part, (begin, end) in ranges.items():
        if raw[part].numel() != end - begin:
            raise ValueError(
                f"part {part!r} of tensor {name!r}: {raw[part].numel()} bytes given for a span "
                f"that needs {end - begin}"
            )
    scales = None
    if codec.is_quantized:
        codes = unpack(raw[CODES], codec.bits, count)
        _check_padding(name, CODES, raw[CODES], codec.bits, count, last)
        scales = _typed(raw[SCALES], torch.float32)
        # scales first: a block of NaN or Inf values has a non-finite scale, and its codes are
        # unspecified (any level), so it is named by its scale
        _check_scales(name, codec, scales, codes, span)
        _check_levels(name, codec, codes, span)
    else:
        codes = _typed(raw[CODES], torch.bfloat16 if codec.values == "bf16" else torch.float32)
        _check_values(name, codes, span)
    indices = None
    if codec.is_sparse:
        indices = unpack(raw[INDICES], codec.index_bits, count).long()
        _check_padding(name, INDICES, raw[INDICES], codec.index_bits, count, last)
        _check_indices(name, layout, indices, span)
    return Encoded(span.numel, codes, scales, indices)


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_padding(
    name: str, part: str, data: torch.Tensor, bits: int, count: int, last: bool
) -> None:
    if last and not padding_is_zero(data, bits, count):
        raise malformed_compressed(
            f"tensor {name!r} part {part!r} has non-zero padding bits after its last value "
            f"(bits {count * bits % 8}-7 of its last byte must be 0)",
            tensor=name,
            part=part,
        )


def _check_levels(name: str, codec: Codec, levels: torch.Tensor, span: Span) -> None:
    if codec.values == "int2" or levels.numel() == 0:
        return  # every 2-bit level is valid
    top = codec.max_level
    if int(levels.amax()) > top:
        at = _first(levels > top)
        raise malformed_compressed(
            f"tensor {name!r} part 'codes' holds level {int(levels[at])} at value "
            f"{span.values[0] + at}; {codec.values} levels are 0..{top}",
            tensor=name,
            part=CODES,
            value=span.values[0] + at,
        )


def _check_scales(
    name: str, codec: Codec, scales: torch.Tensor, levels: torch.Tensor, span: Span
) -> None:
    if scales.numel() == 0:
        return
    offset = codec.level_offset
    top = scales * offset  # the largest magnitude a level decodes to, as the decoder computes it
    # one reduction for every check of a good span (a NaN makes both ends NaN, failing both
    # comparisons; a zero scale makes the low end 0): a span's handful of small checks cost
    # more than its decode
    low, high = (float(end) for end in torch.aminmax(top))
    if not (low >= 0 and high <= _FP32_MAX):
        _refuse_scale(name, scales, top, offset, span)
    if codec.values == "int2" or low > 0:
        return  # with a zero scale every int2 level decodes to 0
    zero = scales == 0
    per_value = zero.repeat_interleave(codec.block)[: levels.numel()]
    wrong = per_value & (levels != QMAX[codec.values])
    if bool(wrong.any()):
        at = _first(wrong)
        block = span.blocks[0] + at // codec.block
        raise malformed_compressed(
            f"tensor {name!r} part 'scales': block {block} has scale 0 but a code other "
            f"than the zero level {QMAX[codec.values]} (level {int(levels[at])} at value "
            f"{span.values[0] + at})",
            tensor=name,
            part=SCALES,
            block=block,
        )


def _refuse_scale(
    name: str, scales: torch.Tensor, top: torch.Tensor, offset: float, span: Span
) -> NoReturn:
    """The first block whose scale is not finite and >= 0, or whose levels would decode to
    Inf: 422 malformed_compressed naming it."""
    bad_scale = ~(torch.isfinite(scales) & (scales >= 0))
    if bool(bad_scale.any()):
        at = _first(bad_scale)
        reason = "scales must be finite and >= 0"
    else:
        at = _first(~torch.isfinite(top))
        reason = f"its levels would decode to Inf ({offset} x scale overflows fp32)"
    block = span.blocks[0] + at
    raise malformed_compressed(
        f"tensor {name!r} part 'scales': block {block} has scale {float(scales[at])!r}; {reason}",
        tensor=name,
        part=SCALES,
        block=block,
    )


def _check_values(name: str, values: torch.Tensor, span: Span) -> None:
    if not all_finite(values):
        at = _first(~torch.isfinite(values))
        raise malformed_compressed(
            f"tensor {name!r} part 'codes' holds {float(values[at])} at value "
            f"{span.values[0] + at}; values must be finite",
            tensor=name,
            part=CODES,
            value=span.values[0] + at,
        )


def _ascending_within_chunks(indices: torch.Tensor, k: int) -> bool:
    """Whether each chunk's indices (k a chunk; a short tail chunk's last, fewer than k)
    strictly ascend: two ops on the rows of k, where finding the first that does not takes
    seven (done only then, for the message)."""
    count = indices.numel()
    whole = count - count % k
    rows = indices[:whole].view(-1, k)
    if not bool((rows[:, 1:] > rows[:, :-1]).all()):
        return False
    tail = indices[whole:]
    return tail.numel() < 2 or bool((tail[1:] > tail[:-1]).all())


def _check_indices(name: str, layout: Layout, indices: torch.Tensor, span: Span) -> None:
    """Indices are < chunk by their width; in the tail chunk they must be < its length, and
    within a chunk strictly ascending (so no index repeats)."""
    codec = layout.codec
    k, chunk = codec.k, codec.chunk
    first_chunk = span.start // chunk
    tail = layout.numel % chunk
    if span.stop == layout.numel and tail:
        kept = min(k, tail)
        tail_indices = indices[indices.numel() - kept :]
        if kept and int(tail_indices.amax()) >= tail:
            at = indices.numel() - kept + _first(tail_indices >= tail)
            raise malformed_compressed(
                f"tensor {name!r} part 'indices' holds index {int(indices[at])} in chunk "
                f"{layout.chunks - 1}, the tail chunk of {tail} elements (indices must be "
                f"< {tail})",
                tensor=name,
                part=INDICES,
                chunk=layout.chunks - 1,
            )
    if indices.numel() < 2 or k == 1 or _ascending_within_chunks(indices, k):
        return
    step = indices[1:] - indices[:-1]
    same_chunk = torch.arange(1, indices.numel(), device=indices.device) % k != 0
    wrong = same_chunk & (step <= 0)
    if bool(wrong.any()):
        at = _first(wrong) + 1
        chunk_at = first_chunk + at // k
        repeated = int(step[at - 1]) == 0
        problem = "repeats index" if repeated else "is not ascending at index"
        raise malformed_compressed(
            f"tensor {name!r} part 'indices' {problem} {int(indices[at])} in chunk {chunk_at} "
            f"(indices within a chunk must be strictly ascending)",
            tensor=name,
            part=INDICES,
            chunk=chunk_at,
        )
