"""Compression codecs for pseudo-gradients and weight deltas: pure torch math, no bytes.

A codec is a value codec, optionally after a top-k selection:
  - `fp32`: values as they are (the identity); `bf16`: a cast, round to nearest even.
  - `int8`, `int4`: blockwise absmax, symmetric mid-tread. Per block of `block` values the scale
    is s = absmax / qmax (qmax 127 or 7) and a value's code is clamp(round(x / s), -qmax, qmax)
    (torch.round: half to even). A block whose scale is 0 (all zeros, or an absmax so small
    that absmax / qmax underflows) has codes 0. Decoded: code * s.
  - `int2`: 2 bits have 4 levels and a zero level would waste one, so int2 is mid-rise: the
    levels are (c - 1.5) * s for c in 0..3, with s = absmax / 1.5 and
    c = clamp(floor(x / s + 2), 0, 3) (nearest level; a value on a boundary goes up). A block
    whose scale is 0 has codes 2 and decodes to 0. Our documented equivalent of SparseLoCo's
    2-bit scheme (Sarfi et al. 2025, arXiv 2508.15706): levels +-0.5 s, +-1.5 s.
  - `topk:F` (+ a value codec, `topk:0.03+int2`): the flat vector is cut into chunks of `chunk`
    elements (the last may be shorter); each chunk keeps its k largest |x|, with
    k = max(1, min(chunk, round(F * chunk))) (Python's round of the binary64 product, half to
    even: F = 0.03, chunk 128 -> 3.84 -> 4; F = 0.01 -> 1.28 -> 1), the tail chunk keeps
    min(k, its length). Indices are chunk-local, in [0, chunk), ascending within a chunk so
    that an encoding is canonical. The kept values, in chunk order, are then coded by the value
    codec with its blocks. Ties between equal magnitudes may go either way (the decoder does
    not care); this encoder takes the lower index in full chunks when k <= 16.

Codes of int8 / int4 / int2 are kept as unsigned levels, one per uint8: code + qmax for int8
and int4 (0..254, 0..14), c for int2 (0..3), so that bit packing (wire/compressed/body.py) treats
every width alike. All math is fp32 in the order written above: the division x / s, and the
decode (level - offset) * s as a separate multiply (no fused multiply-add), so every device
decodes the same codes to bit-identical values. Values that are NaN or Inf make their block's
scale NaN or Inf, which every receiver refuses; such a block's codes are unspecified (so is what
`encode`'s fold adds for it: NaN or Inf).

The work is done on pieces of 2 MiB of fp32 on CPU (whole blocks and chunks, see `Layout`) so
that each vectorized pass stays in cache; no Python loop runs over elements, blocks or chunks
(top-k's selection loops over the k ranks, at most 16, all chunks at once). Same code on CPU
and CUDA.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from diloco.algorithm.compression.fused_int8 import add_decoded
from diloco.algorithm.tensors import SparsePiece

VALUE_CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "int2")
ALLOWED_CODECS = "fp32, bf16, int8, int4, int2, topk:F, topk:F+VALUES"
BLOCK_RANGE = (8, 65536)
CHUNK_RANGE = (2, 65536)
QMAX = {"int8": 127, "int4": 7}
INT2_HALF_RANGE = 1.5  # int2 levels are (c - 1.5) * s, s = absmax / 1.5
_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}
_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}
_CPU_PIECE = 1 << 19  # elements per piece on CPU: 2 MiB of fp32 (measured best of 2^17-2^21)
_DEVICE_PIECE = 1 << 24  # on an accelerator: fewer, larger launches
_SPARSE_READ = 1 << 23  # elements per span a receiver reads of a top-k tensor (read_elements)
_ITERATIVE_TOP_K = 16  # up to this k, top-k by k max-passes; above, torch.topk
_OUT_OF_RUNNING = -1  # a taken key: below every key left in its row (all are >= 0)
_LOW_WORD = 0xFFFFFFFF


def _check_power_of_two(field: str, value: object, low: int, high: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not (ok and low <= value <= high and value & (value - 1) == 0):  # type: ignore[operator]
        raise ValueError(
            f"{field} must be a positive power of two in [{low}, {high}], got {value!r}"
        )
    return int(value)  # type: ignore[arg-type]


def _check_fraction(value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 0 < value <= 1):  # type: ignore[arg-type]
        raise ValueError(f"top-k fraction must be in (0, 1], got {value!r}")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Codec:
    """A value codec (`values`), after a top-k selection of `fraction` per chunk when given."""

    values: str = "fp32"
    fraction: float | None = None  # top-k fraction F; None: dense (every value is sent)
    block: int = 128  # values per quantization scale
    chunk: int = 128  # elements per top-k chunk

    def __post_init__(self) -> None:
        if self.values not in VALUE_CODECS:
            raise ValueError(
                f"unknown value codec {self.values!r}; allowed: {', '.join(VALUE_CODECS)}"
            )
        if self.fraction is not None:
            object.__setattr__(self, "fraction", _check_fraction(self.fraction))
        _check_power_of_two("block size", self.block, *BLOCK_RANGE)
        _check_power_of_two("chunk size", self.chunk, *CHUNK_RANGE)

    @property
    def is_identity(self) -> bool:
        """fp32, dense: what the codec sends is the input itself."""
        return self.values == "fp32" and self.fraction is None

    @property
    def is_sparse(self) -> bool:
        return self.fraction is not None

    @property
    def is_quantized(self) -> bool:
        """int8, int4 or int2 values: levels with one fp32 scale per block."""
        return self.values in ("int8", "int4", "int2")

    @property
    def bits(self) -> int:
        """Bits of one coded value."""
        return _BITS[self.values]

    @property
    def max_level(self) -> int:
        """The largest valid level: 254 (int8), 14 (int4), 3 (int2); 0 for fp32/bf16."""
        if self.values == "int2":
            return 3
        return 2 * QMAX.get(self.values, 0)

    @property
    def level_offset(self) -> float:
        """qmax for int8/int4 (127, 7), 1.5 for int2: the scale is absmax / this, a level
        decodes to (level - this) * scale, and this times the scale is the largest magnitude."""
        return float(QMAX.get(self.values, INT2_HALF_RANGE)) if self.is_quantized else 0.0

    @property
    def k(self) -> int:
        """Values kept per top-k chunk (see the module's rounding rule); 0 for a dense codec."""
        if self.fraction is None:
            return 0
        return max(1, min(self.chunk, round(self.fraction * self.chunk)))

    @property
    def index_bits(self) -> int:
        """Bits of one chunk-local index, log2(chunk); 0 for a dense codec."""
        return self.chunk.bit_length() - 1 if self.is_sparse else 0

    def __str__(self) -> str:
        if self.fraction is None:
            return self.values
        suffix = "" if self.values == "fp32" else f"+{self.values}"
        return f"topk:{self.fraction!r}{suffix}"


# A receiver decodes a top-k tensor at least one group (Layout.group_elements) at a time.
MAX_GROUP_ELEMENTS = 1 << 20


def parse_codec(text: str, *, block: int = 128, chunk: int = 128) -> Codec:
    """A codec from its spec ("int8", "topk:0.03+int2", "bfloat16"...); case and surrounding
    spaces do not matter. A bare "topk:F" keeps fp32 values. ValueError names what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"a codec must be a string, got {text!r}; allowed: {ALLOWED_CODECS}")
    spec = text.strip().lower()
    if not spec.startswith("topk:"):
        values = _ALIASES.get(spec, spec)
        if values not in VALUE_CODECS:
            raise ValueError(f"unknown codec {text.strip()!r}; allowed: {ALLOWED_CODECS}")
        return Codec(values, None, block, chunk)
    fraction_text, plus, values_text = spec[len("topk:") :].partition("+")
    values = _ALIASES.get(values_text.strip(), values_text.strip()) if plus else "fp32"
    if values not in VALUE_CODECS:
        raise ValueError(
            f"unknown value codec {values_text.strip()!r} in {text.strip()!r}; "
            f"allowed after 'topk:F+': {', '.join(VALUE_CODECS)}"
        )
    try:
        fraction = float(fraction_text.strip())
    except ValueError:
        raise ValueError(
            f"top-k fraction must be a number in (0, 1], got {fraction_text.strip()!r}"
        ) from None
    if math.isfinite(fraction) and fraction > 1:
        raise ValueError(
            f"top-k fraction must be in (0, 1], got {fraction_text.strip()}: each chunk of "
            f"{chunk} would keep k = round({fraction_text.strip()} x {chunk}) = "
            f"{round(fraction * chunk)} values, more than it holds"
        )
    if not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise ValueError(f"top-k fraction must be in (0, 1], got {fraction_text.strip()}")
    codec = Codec(values, fraction, block, chunk)
    if (group := Layout(0, codec).group_elements) > MAX_GROUP_ELEMENTS:
        raise ValueError(
            f"{text.strip()} with block {block} and chunk {chunk} decodes in groups of {group} "
            f"values; at most {MAX_GROUP_ELEMENTS} are allowed: choose a smaller block or chunk"
        )
    return codec


def require_kept_values(codec: Codec) -> Codec:
    """`codec`, refused (ValueError naming k, the fraction and the chunk) when its top-k
    fraction keeps round(F x chunk) = 0 values per chunk: the k = max(1, ...) rule would then
    send 1 per chunk, far more than the fraction asked for. For the settings a user gives (the
    server's and the simulator's); a worker adopts what its server has already checked."""
    if codec.fraction is None or round(codec.fraction * codec.chunk) >= 1:
        return codec
    fits = [c for c in _powers_of_two(*CHUNK_RANGE) if round(codec.fraction * c) >= 1]
    larger = f" or a chunk of at least {fits[0]}" if fits else ""
    raise ValueError(
        f"top-k {codec} keeps k = round({codec.fraction!r} x {codec.chunk}) = 0 values of each "
        f"chunk of {codec.chunk} (k must be at least 1): give a fraction of at least "
        f"1/{codec.chunk} = {1 / codec.chunk:.4g}{larger}"
    )


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << bits for bits in range(low.bit_length() - 1, high.bit_length())]


# ------------------------------------------------------------------ where everything sits


@dataclass(frozen=True)
class Span:
    """A run of whole groups of one tensor, and the slice of every part that codes it.

    `start`/`stop` are elements of the flat tensor; `values` and `blocks` index the coded values
    and the scales; the byte ranges are those of each part once packed (codes at `bits` per
    value, scales as fp32, indices at `index_bits` each), from the part's first byte.
    """

    first_group: int
    end_group: int
    start: int
    stop: int
    values: tuple[int, int]
    blocks: tuple[int, int]
    code_bytes: tuple[int, int]
    scale_bytes: tuple[int, int]
    index_bytes: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Layout:
    """How a flat tensor of `numel` elements is coded by `codec`: counts, sizes and groups.

    A group is the smallest run of elements whose parts all start on whole bytes and whole
    blocks: one block for a dense codec; for top-k, g chunks with g * k a whole number of
    blocks (of 8 values for fp32/bf16 values), g = that / gcd(k, that). Any run of whole groups
    (a `Span`) can be decoded from its own slices of the parts, which is how a receiver decodes
    a tensor piece by piece; the last group may be short.
    """

    numel: int
    codec: Codec

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or isinstance(self.numel, bool) or self.numel < 0:
            raise ValueError(f"numel must be an integer >= 0, got {self.numel!r}")

    def values_before(self, element: int) -> int:
        """Coded values for the elements before `element` (a chunk boundary, or numel)."""
        codec = self.codec
        if not codec.is_sparse:
            return element
        full, rest = divmod(element, codec.chunk)
        return full * codec.k + min(codec.k, rest)

    @property
    def values(self) -> int:
        return self.values_before(self.numel)

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.codec.chunk) if self.codec.is_sparse else 0

    @property
    def blocks(self) -> int:
        return -(-self.values // self.codec.block) if self.codec.is_quantized else 0

    @property
    def group_elements(self) -> int:
        codec = self.codec
        if not codec.is_sparse:
            return codec.block
        align = codec.block if codec.is_quantized else 8
        return align // math.gcd(codec.k, align) * codec.chunk

    @property
    def groups(self) -> int:
        return -(-self.numel // self.group_elements)

    @property
    def codes_nbytes(self) -> int:
        return -(-self.values * self.codec.bits // 8)

    @property
    def scales_nbytes(self) -> int:
        return 4 * self.blocks

    @property
    def indices_nbytes(self) -> int:
        return -(-self.values * self.codec.index_bits // 8)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: packed codes, scales, packed indices."""
        return self.codes_nbytes + self.scales_nbytes + self.indices_nbytes

    def span(self, first_group: int, end_group: int) -> Span:
        """Groups [first_group, end_group) and the slices of the parts that code them."""
        if not 0 <= first_group <= end_group <= self.groups:
            raise ValueError(f"groups [{first_group}, {end_group}) are outside [0, {self.groups}]")
        codec = self.codec
        start = min(first_group * self.group_elements, self.numel)
        stop = min(end_group * self.group_elements, self.numel)
        first, last = self.values_before(start), self.values_before(stop)
        block = codec.block if codec.is_quantized else 0
        blocks = _units(first, last, block)
        return Span(
            first_group,
            end_group,
            start,
            stop,
            (first, last),
            blocks,
            _units(first * codec.bits, last * codec.bits, 8),
            (4 * blocks[0], 4 * blocks[1]),
            _units(first * codec.index_bits, last * codec.index_bits, 8),
        )

    def spans(self, max_elements: int) -> Iterator[Span]:
        """Consecutive spans of at most `max_elements` (at least one group each) covering all."""
        step = max(1, max_elements // self.group_elements)
        for first in range(0, self.groups, step):
            yield self.span(first, min(first + step, self.groups))


def _units(first: int, last: int, size: int) -> tuple[int, int]:
    """The units of `size` items that hold items [first, last): whole units (first is on a
    boundary but at the very end); empty when the range is. Size 0: no units at all."""
    if size == 0:
        return (0, 0)
    end = -(-last // size)
    return (first // size if last > first else end, end)


def encoded_nbytes(numel: int, codec: Codec) -> int:
    """Exact bytes on the wire of one tensor of `numel` elements: codes, scales, indices."""
    return Layout(numel, codec).nbytes


# ------------------------------------------------------------------ encoded tensors


@dataclass(frozen=True)
class Encoded:
    """One coded flat tensor: `codes` (uint8 levels, or fp32/bf16 values), `scales` (fp32, one
    per block; None for fp32/bf16 values), `indices` (int64 chunk-local; None when dense)."""

    numel: int
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None

    def select(self, span: Span) -> Encoded:
        """The encoding of the span's elements alone: views of the matching slices."""
        (v0, v1), (b0, b1) = span.values, span.blocks
        return Encoded(
            span.numel,
            self.codes[v0:v1],
            None if self.scales is None else self.scales[b0:b1],
            None if self.indices is None else self.indices[v0:v1],
        )

    def to(self, device: torch.device) -> Encoded:
        """The same encoding on `device` (itself when it is there already): a receiver reads
        parts into CPU memory and decodes next to its target, which may be a GPU's."""
        if self.codes.device == device:
            return self
        return Encoded(
            self.numel,
            self.codes.to(device),
            None if self.scales is None else self.scales.to(device),
            None if self.indices is None else self.indices.to(device),
        )


def piece_elements(device: torch.device) -> int:
    """Elements per piece of work on `device`: cache-sized on CPU, large on accelerators."""
    return _CPU_PIECE if device.type == "cpu" else _DEVICE_PIECE


def read_elements(codec: Codec, device: torch.device) -> int:
    """Elements per span a receiver reads, checks and adds of a tensor coded with `codec`,
    on `device`: a top-k span's parts hold k / chunk of its values and it is added as them
    alone, so its spans hold as many kept values as a piece holds values (capped at 2^23
    elements): its many small checks cost per span, not per value (spans of 2^19 made a 25M
    model's topk:0.03 scan 125 spans, one per tensor being 101)."""
    pieces = piece_elements(device)
    if not codec.is_sparse:
        return pieces
    return max(pieces, min(_SPARSE_READ, pieces * codec.chunk // codec.k))


def _code_dtype(codec: Codec) -> torch.dtype:
    if codec.is_quantized:
        return torch.uint8
    return torch.bfloat16 if codec.values == "bf16" else torch.float32


def encode(
    x: torch.Tensor,
    codec: Codec,
    *,
    out: Encoded | None = None,
    fold_into: torch.Tensor | None = None,
    weight: float = 1.0,
) -> Encoded:
    """Code the floating tensor `x` (any shape, taken flat); the result owns new memory, or is
    `out` (parts of the encoding's sizes and dtypes, e.g. slots of a body).

    `fold_into` (a contiguous fp32 tensor of x's size on x's device; may be x itself): += weight
    * the decoded encoding, bit for bit what `decode_into` of the result would add, each piece
    as soon as it is coded (error feedback; a server's published copy). A dense int codec adds
    the levels it has in hand times the scales, the very products the decoder makes from the
    codes, without reading the codes back."""
    if not x.is_floating_point():
        raise ValueError(f"only floating tensors are coded, got {x.dtype}")
    flat = x.detach().reshape(-1)
    layout = Layout(flat.numel(), codec)
    device = flat.device
    encoded = _encoding(layout, device) if out is None else _checked_out(out, layout, device)
    target = None
    if fold_into is not None:
        _check_target(fold_into, layout.numel, "fold_into")
        if fold_into.device != device:
            raise ValueError(f"fold_into must be on {device}, got {fold_into.device}")
        target = fold_into.view(-1)
    if not codec.is_sparse and not codec.is_quantized:
        encoded.codes.copy_(flat)  # fp32 or bf16: one (casting) copy
        if fold_into is not None:
            decode_into(encoded, codec, fold_into, weight)
        return encoded
    keys = _CPU_KEYS if device.type == "cpu" else _KeyCache()
    levels_in_hand = target is not None and not codec.is_sparse  # else decoded from the codes
    for span in layout.spans(piece_elements(device)):
        piece = encoded.select(span)
        values = flat[span.start : span.stop]
        if values.dtype != torch.float32:
            values = values.float()
        if codec.is_sparse:
            assert piece.indices is not None
            values = _select_top_k(values, codec, piece.indices, keys)
        decoded = _code_values(values, codec, piece, decoded=levels_in_hand)
        if target is None:
            continue
        if decoded is not None:
            target[span.start : span.stop].add_(decoded, alpha=weight)
        else:
            decode_into(piece, codec, target[span.start : span.stop], weight)
    return encoded


def _encoding(layout: Layout, device: torch.device) -> Encoded:
    """An empty encoding of `layout`'s sizes on `device`."""
    codec = layout.codec
    return Encoded(
        layout.numel,
        torch.empty(layout.values, dtype=_code_dtype(codec), device=device),
        torch.empty(layout.blocks, dtype=torch.float32, device=device)
        if codec.is_quantized
        else None,
        torch.empty(layout.values, dtype=torch.int64, device=device) if codec.is_sparse else None,
    )


def _checked_out(out: Encoded, layout: Layout, device: torch.device) -> Encoded:
    """`out` when its parts have the sizes and dtypes `layout`'s encoding needs, on `device`."""
    codec = layout.codec
    if out.numel != layout.numel:
        raise ValueError(f"out must encode {layout.numel} elements, got {out.numel}")
    wanted = {
        "codes": (layout.values, _code_dtype(codec)),
        "scales": (layout.blocks, torch.float32) if codec.is_quantized else None,
        "indices": (layout.values, torch.int64) if codec.is_sparse else None,
    }
    for part, want in wanted.items():
        got = getattr(out, part)
        if want is None:
            if got is not None:
                raise ValueError(f"out.{part} must be None for {codec}")
            continue
        numel, dtype = want
        if got is None or (got.numel(), got.dtype) != want or not got.is_contiguous():
            found = "None" if got is None else f"{got.dtype} of {got.numel()} elements"
            raise ValueError(
                f"out.{part} must be a contiguous {dtype} tensor of {numel} elements for "
                f"{codec}, got {found}"
                + ("" if got is None or got.is_contiguous() else " (not contiguous)")
            )
        if got.device != device:
            raise ValueError(
                f"out.{part} must be on {device}, the values' device, got {got.device}"
            )
    return out


def _code_values(
    values: torch.Tensor, codec: Codec, piece: Encoded, decoded: bool = False
) -> torch.Tensor | None:
    """Code fp32 `values` (whole blocks, but for the tensor's last) into `piece`. `decoded`
    (int codecs): also return what the piece decodes to, in a buffer of its own."""
    if not codec.is_quantized:
        piece.codes.copy_(values)
        return None
    assert piece.scales is not None
    count = values.numel()
    padded = piece.scales.numel() * codec.block
    if padded != count:  # the last block is short: pad it with zeros
        values = torch.cat([values, values.new_zeros(padded - count)])
    blocks = values.view(-1, codec.block)
    # exact; torch's CPU aminmax along rows of a block is ~10x slower than abs and amax
    absmax = blocks.abs().amax(dim=1)
    # by a tensor, not a Python number: CUDA multiplies by the reciprocal of a number (off by
    # an ulp now and then), and a scale must be the same on every device
    torch.div(absmax, absmax.new_tensor(codec.level_offset), out=piece.scales)
    safe = torch.where(piece.scales == 0, math.inf, piece.scales)  # x / inf = 0: zero codes
    scaled = torch.div(blocks, safe.unsqueeze(1))
    levels = scaled.view(-1)[:count]
    # The levels are whole numbers that fit an int8: fp32 to int8 is exact, and on CPU
    # several times faster than fp32 to uint8 (the unsigned level is then added in place).
    signed = piece.codes.view(torch.int8)
    if codec.values == "int2":
        scaled.add_(2).floor_().clamp_(0, 3)
        signed.copy_(levels)
        if decoded:
            levels.sub_(INT2_HALF_RANGE)  # c - 1.5, exactly the decoder's
    else:
        qmax = QMAX[codec.values]
        scaled.round_().clamp_(-qmax, qmax)
        signed.copy_(levels)
        if decoded:  # the code as the decoder's level - qmax gives it (0 is +0, never -0)
            levels.copy_(signed)
        piece.codes.add_(qmax)  # c + qmax in 0..2 qmax: exact in uint8
    if not decoded:
        return None
    _scale_blocks(levels, piece.scales, codec.block)
    return levels


class _KeyCache(threading.local):
    """An int64 key per element of a piece, reused by the pieces of an encode and, on CPU, by
    later encodes of the same thread: a piece's worth (4 MiB at the default pieces), which a
    fresh allocation per piece would map and page-fault in anew; and, per chunk size, the row
    of chunk - 1 - column that every row's low words take."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.low: torch.Tensor | None = None

    def get(self, rows: int, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        keys, low = self.keys, self.low
        if keys is None or keys.numel() < rows * chunk or keys.device != device:
            keys = self.keys = torch.empty(rows * chunk, dtype=torch.int64, device=device)
        if low is None or low.shape[1] != chunk or low.device != device:
            low = torch.arange(chunk - 1, -1, -1, dtype=torch.int64, device=device)
            low = self.low = low.view(1, chunk)
        return keys[: rows * chunk].view(rows, chunk), low


_CPU_KEYS = _KeyCache()


def _select_top_k(
    x: torch.Tensor, codec: Codec, indices: torch.Tensor, keys: _KeyCache
) -> torch.Tensor:
    """The kept values of fp32 `x` (whole chunks, the tail last) in chunk order; their
    chunk-local indices go into `indices`."""
    chunk, k = codec.chunk, codec.k
    full = x.numel() // chunk
    kept = torch.empty(indices.numel(), dtype=torch.float32, device=x.device)
    if full:
        rows = x[: full * chunk].view(full, chunk)
        columns = _top_k_columns(rows, k, keys)
        indices[: full * k].copy_(columns.view(-1))
        torch.gather(rows, 1, columns, out=kept[: full * k].view(full, k))
    tail = x[full * chunk :]
    if tail.numel():  # one short row, its ties broken as a whole chunk's are
        row = tail.reshape(1, -1)
        columns = _top_k_columns(row, min(k, tail.numel()), _KeyCache()).view(-1)
        indices[full * k :].copy_(columns)
        kept[full * k :].copy_(tail[columns])
    return kept


def _top_k_columns(rows: torch.Tensor, k: int, keys: _KeyCache) -> torch.Tensor:
    """Per row, the columns of the k largest |x|, ascending; ties to the lower column.

    Each element gets a unique int64 key: the bits of |x| (ordered as |x| is, being a
    non-negative float) in the high word, chunk - 1 - column in the low one. The row's largest
    key is found by a max; the next by a max once the last is out of the running: its column
    (its key's low word) names it, and it is made -1, below every key left (one small
    scatter). k max passes in all, where a comparison mask is slow on CPU and a pass that
    shifts every key took three.
    """
    count, chunk = rows.shape
    key, columns = keys.get(count, chunk, rows.device)
    # |x|'s bits, then up into the high word, the reversed column in the low one: whole-word
    # ops on contiguous keys (writing the high words of int32 pairs in place was a strided
    # write, twice as slow as these four)
    key.copy_(rows.view(torch.int32))  # (sign-extended: the and below drops the sign)
    key.bitwise_and_(0x7FFFFFFF).bitwise_left_shift_(32).bitwise_or_(columns)
    if k > _ITERATIVE_TOP_K:  # the keys are unique: any device's top-k finds the same set
        low = key.topk(k, dim=1, sorted=False).values.bitwise_and_(_LOW_WORD)
        return torch.sub(chunk - 1, low).sort(dim=1).values
    found = []
    for rank in range(k):
        last = key.amax(1, keepdim=True)
        found.append(last)
        if rank + 1 < k:
            key.scatter_(1, torch.sub(chunk - 1, last.bitwise_and(_LOW_WORD)), _OUT_OF_RUNNING)
    low = torch.cat(found, 1).bitwise_and_(_LOW_WORD)
    return torch.sub(chunk - 1, low).sort(dim=1).values


# ------------------------------------------------------------------ decoding


def _check_target(target: torch.Tensor, numel: int, what: str) -> None:
    if target.dtype != torch.float32 or not target.is_contiguous() or target.numel() != numel:
        raise ValueError(
            f"{what} must be a contiguous fp32 tensor of {numel} elements, got "
            f"{target.dtype} with {target.numel()} elements"
            + ("" if target.is_contiguous() else " (not contiguous)")
        )


def decode(encoded: Encoded, codec: Codec, out: torch.Tensor | None = None) -> torch.Tensor:
    """The decoded flat fp32 tensor (written into `out` when given)."""
    if out is None:
        out = torch.empty(encoded.numel, dtype=torch.float32, device=encoded.codes.device)
    _check_target(out, encoded.numel, "out")
    flat = out.view(-1)
    if codec.is_sparse:
        decode_sparse(encoded, codec).dense(flat)
        return out
    if not codec.is_quantized:
        flat.copy_(encoded.codes)
        return out
    for span in Layout(encoded.numel, codec).spans(piece_elements(flat.device)):
        _dequantize(encoded.select(span), codec, into=flat[span.start : span.stop])
    return out


def decode_sparse(encoded: Encoded, codec: Codec) -> SparsePiece:
    """A top-k encoding decoded as its kept values and their positions (nothing written for
    the zeros between them): `decode` is its `dense()`."""
    if not codec.is_sparse:
        raise ValueError(f"codec {codec} is not sparse: decode it whole")
    if not encoded.numel:
        empty = encoded.codes.new_empty(0, dtype=torch.float32)
        return SparsePiece(0, empty.long(), empty)
    positions, values = _sparse_parts(encoded, codec)
    return SparsePiece(encoded.numel, positions, values)


def decode_into(
    encoded: Encoded, codec: Codec, target: torch.Tensor, weight: float = 1.0
) -> torch.Tensor:
    """target += weight * decode(encoded), on a contiguous flat-able fp32 `target`; top-k
    touches only the kept positions, dense codecs work piece by piece (no full temporary)."""
    _check_target(target, encoded.numel, "target")
    flat = target.view(-1)
    if codec.is_sparse:
        if encoded.numel:
            positions, values = _sparse_parts(encoded, codec)
            if flat.device.type == "cpu":
                flat.index_add_(0, positions, values, alpha=weight)
            else:  # CUDA's index_add_ adds atomically, flushing subnormals to zero; the
                # positions are unique, so gather, add and scatter give the CPU's sums
                flat.index_put_((positions,), flat[positions].add_(values, alpha=weight))
        return target
    for span in Layout(encoded.numel, codec).spans(piece_elements(flat.device)):
        piece, part = flat[span.start : span.stop], encoded.select(span)
        if codec.is_quantized:
            if weight == 1.0 and codec.bits == 8 and add_decoded(*_parts(part), piece, codec.block):
                continue  # the fused kernel's bytes are these (see fused_int8)
            piece.add_(_dequantize(part, codec), alpha=weight)
        else:  # fp32 or bf16: a bf16 operand is converted piece by piece
            piece.add_(part.codes.float(), alpha=weight)
    return target


def _parts(encoded: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    assert encoded.scales is not None
    return encoded.codes, encoded.scales


def _dequantize(encoded: Encoded, codec: Codec, into: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of quantized `encoded` (levels and scales, whole blocks but the last)."""
    assert encoded.scales is not None
    levels = encoded.codes
    if into is None:
        into = torch.empty(levels.shape, dtype=torch.float32, device=levels.device)
    # level - offset from the codes into fp32 (exact: small whole numbers and halves), then
    # times each block's scale in place: the same fp32 products as ever. On CPU a converting
    # copy and an in-place subtraction are faster than torch's uint8 - float in one op.
    if into.device.type == "cpu":
        into.copy_(levels).sub_(codec.level_offset)
    else:
        torch.sub(levels, codec.level_offset, out=into)
    _scale_blocks(into, encoded.scales, codec.block)
    return into


def _scale_blocks(into: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """`into` (levels - offset, fp32, whole blocks but the last) times each block's scale, in
    place: a separate multiply, never fused with an add, so every device rounds alike."""
    count = into.numel()
    full = count // block * block
    if full:
        into[:full].view(-1, block).mul_(scales[: full // block].unsqueeze(1))
    if full != count:
        into[full:].mul_(scales[full // block])


def _sparse_parts(encoded: Encoded, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions and fp32 values of a top-k encoding: value j is in chunk j // k."""
    assert encoded.indices is not None
    dense = Encoded(encoded.codes.numel(), encoded.codes, encoded.scales)
    values_codec = Codec(codec.values, None, codec.block, codec.chunk)
    quantized = codec.is_quantized
    values = _dequantize(dense, values_codec) if quantized else encoded.codes.float()
    order = torch.arange(encoded.indices.numel(), device=encoded.indices.device)
    positions = order.div_(codec.k, rounding_mode="floor").mul_(codec.chunk).add_(encoded.indices)
    return positions, values


def max_abs(encoded: Encoded, codec: Codec) -> float:
    """A bound of every decoded magnitude: from the scales alone for quantized codecs (the
    largest level times the largest scale, the same fp32 multiply the decoder does), from the
    values themselves for fp32/bf16."""
    if encoded.codes.numel() == 0:
        return 0.0
    if codec.is_quantized:
        assert encoded.scales is not None
        return float(encoded.scales.amax() * codec.level_offset)
    return float(encoded.codes.abs().amax())


# ------------------------------------------------------------------ error feedback


def error_feedback_step(
    residual: torch.Tensor, g: torch.Tensor, beta: float, codec: Codec
) -> tuple[Encoded, torch.Tensor]:
    """One step of error feedback: e <- beta e + g; send C(e); e <- e - D(C(e)).

    `residual` (a contiguous fp32 tensor, e) is updated in place and returned beside what to
    send; `g` has its number of elements (any floating dtype). beta must be in [0, 1).
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise ValueError(f"error-feedback beta must be in [0, 1), got {beta!r}")
    _check_target(residual, g.numel(), "residual")
    residual.mul_(beta).add_(g.detach().reshape(residual.shape))
    encoded = encode(residual, codec, fold_into=residual, weight=-1.0)
    return encoded, residual
