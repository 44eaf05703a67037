"""Bit packing of small unsigned integers into bytes, and back; vectorized torch, no loops.

`count` values of `bits` bits each become ceil(count * bits / 8) bytes. The stream is
little-endian at every level: value i occupies bits [i * bits, (i + 1) * bits) of the stream,
lowest bit first, and stream bit j is bit (j % 8) of byte j // 8. So with 2 bits, byte 0 holds
value 0 in its bits 0-1, value 1 in bits 2-3, and so on; with 7 bits, value 1 starts at bit 7
of byte 0 and goes on in bits 0-5 of byte 1. The bits after the last value, in the last byte,
are zero (a reader refuses others: `padding_is_zero`).

Fast paths: widths 1, 2, 4 and 8 shift whole machine words (a byte per value seen as one int64,
int32 or int16 word); widths whose 8-value group fits in 56 bits (3, 5, 6, 7, 10, 12, 14, 16)
gather each group into one int64 word; the others (9, 11, 13, 15) expand to single bits.
"""

from __future__ import annotations

import math
import sys

import torch

_LITTLE = sys.byteorder == "little"  # the word tricks read bytes of words in memory order
# bits -> (word dtype, bytes per value in a word): a word of bytes, one value per byte.
_WORDS = {1: torch.int64, 2: torch.int32, 4: torch.int16}
_SPREAD_MASK = {1: 0x0101010101010101, 2: 0x03030303, 4: 0x0F0F}


def packed_nbytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bit width must be an integer in [1, 16], got {bits!r}")


def pack(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack 1-D non-negative integers below 2**bits into bytes (a 1-D uint8 tensor; `out`,
    when given, must have exactly packed_nbytes(len(values), bits) elements)."""
    _check_bits(bits)
    count = values.numel()
    nbytes = packed_nbytes(count, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=values.device)
    if out.dtype != torch.uint8 or out.numel() != nbytes:
        raise ValueError(f"out must be a uint8 tensor of {nbytes} elements")
    if count == 0:
        return out
    if bits == 8:
        out.copy_(values)
    elif bits in _WORDS and _LITTLE:
        _pack_words(values, bits, out)
    elif _group_bytes(bits) <= 7 and _LITTLE:
        _pack_groups(values, bits, out)
    else:
        _pack_expanded(values, bits, out)
    return out


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values packed in the 1-D uint8 tensor `data` (which must hold
    packed_nbytes(count, bits) bytes): uint8 for widths up to 8, int64 above."""
    _check_bits(bits)
    if data.dtype != torch.uint8 or data.numel() != packed_nbytes(count, bits):
        raise ValueError(f"data must be a uint8 tensor of {packed_nbytes(count, bits)} bytes")
    dtype = torch.uint8 if bits <= 8 else torch.int64
    if count == 0:
        return torch.empty(0, dtype=dtype, device=data.device)
    if bits == 8:
        return data
    if bits in _WORDS and _LITTLE:
        return _unpack_words(data, bits, count)
    if _group_bytes(bits) <= 7 and _LITTLE:
        return _unpack_groups(data, bits, count).to(dtype)
    return _unpack_expanded(data, bits, count).to(dtype)


def padding_is_zero(data: torch.Tensor, bits: int, count: int) -> bool:
    """True when the bits after the last of `count` values in `data`'s last byte are zero."""
    used = count * bits % 8
    if used == 0 or data.numel() == 0:
        return True
    return int(data[-1]) >> used == 0


# ------------------------------------------------------------------ widths 1, 2, 4


def _padded(values: torch.Tensor, multiple: int, dtype: torch.dtype) -> torch.Tensor:
    """`values` as contiguous `dtype`, zero-padded to a multiple of `multiple` elements."""
    count = values.numel()
    size = -(-count // multiple) * multiple
    if size == count and values.dtype == dtype and values.is_contiguous():
        return values
    padded = torch.zeros(size, dtype=dtype, device=values.device)
    padded[:count].copy_(values)
    return padded


def _pack_words(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Each word holds 8 / bits values, one per byte; shifting byte j down by j * (8 - bits)
    puts its value at bit j * bits, and the word's low byte is the packed byte."""
    per = 8 // bits
    words = _padded(values, per, torch.uint8).view(_WORDS[bits])
    packed = words.clone()
    for j in range(1, per):  # over the values of one word (at most 8), not over elements
        packed.bitwise_or_(words >> (j * (8 - bits)))
    out.copy_(packed[: out.numel()])  # the cast to uint8 keeps the low byte


def _unpack_words(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per = 8 // bits
    dtype = _WORDS[bits]
    words = data.to(dtype)
    spread = words.clone()
    for j in range(1, per):
        spread.bitwise_or_(words << (j * (8 - bits)))
    spread.bitwise_and_(_SPREAD_MASK[bits])
    return spread.view(torch.uint8)[:count]


# ------------------------------------------------------------------ groups in one int64


def _group_values(bits: int) -> int:
    """Values in the smallest run that fills whole bytes: 8 / gcd(bits, 8)."""
    return 8 // math.gcd(bits, 8)


def _group_bytes(bits: int) -> int:
    return _group_values(bits) * bits // 8


def _pack_groups(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    per = _group_values(bits)
    groups = _padded(values, per, torch.int64).view(-1, per)
    shifts = torch.arange(per, device=values.device, dtype=torch.int64) * bits
    words = (groups << shifts).sum(1)  # the fields do not overlap: the sum is their OR
    width = _group_bytes(bits)
    packed = words.view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)
    out.copy_(packed[: out.numel()])


def _unpack_groups(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per, width = _group_values(bits), _group_bytes(bits)
    rows = _padded(data, width, torch.uint8).view(-1, width)
    raw = torch.zeros(rows.shape[0], 8, dtype=torch.uint8, device=data.device)
    raw[:, :width].copy_(rows)
    shifts = torch.arange(per, device=data.device, dtype=torch.int64) * bits
    fields = (raw.view(torch.int64) >> shifts).bitwise_and_((1 << bits) - 1)
    return fields.view(-1)[:count]


# ------------------------------------------------------------------ any width, bit by bit


def _pack_expanded(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    count = values.numel()
    place = torch.arange(bits, device=values.device, dtype=torch.int64)
    stream = ((values.to(torch.int64).view(-1, 1) >> place) & 1).view(-1)
    padded = torch.zeros(out.numel() * 8, dtype=torch.int64, device=values.device)
    padded[: count * bits].copy_(stream)
    weights = torch.arange(8, device=values.device, dtype=torch.int64)
    out.copy_((padded.view(-1, 8) << weights).sum(1))


def _unpack_expanded(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    place = torch.arange(8, device=data.device, dtype=torch.int64)
    stream = ((data.to(torch.int64).view(-1, 1) >> place) & 1).view(-1)[: count * bits]
    weights = torch.arange(bits, device=data.device, dtype=torch.int64)
    return (stream.view(count, bits) << weights).sum(1)
