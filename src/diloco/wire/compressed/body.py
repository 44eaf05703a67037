"""Compressed tensor bodies: a codec's parts as the entries of an ordinary safetensors frame.

A compressed tensor NAME travels as up to three entries (docs/protocol.md, "Compressed
bodies"): `NAME#codes` (U8: levels packed at the codec's bits, see wire/compressed/bitpack.py;
or the F32 / BF16 values of an fp32 / bf16 value codec), `NAME#scales` (F32, one per block;
int codecs only) and `NAME#indices` (U8: chunk-local indices packed at log2(chunk) bits;
top-k only). Tensors sent exact (int and bool buffers, and any name the caller lists) keep
their plain entry NAME.
The header's `__metadata__` names the codec, so a receiver refuses a body coded otherwise
before it reads a value. Because the body is an ordinary frame, the strict parser, the spool
and the early header check all work on it unchanged.

Sending: `encode_compressed` (a whole body) or `write_parts` (one tensor into its part slots).
Receiving is two steps: `check_compressed_header` (wire/compressed/header.py) checks names,
parts, dtypes and byte lengths against what the receiver expects, no value read; `read_span`
(wire/compressed/values.py) then checks and unpacks one span of one tensor from its slices of
the parts, so a server can decode piece by piece from a file. `decode_compressed` does both
for a body in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from diloco.algorithm.compression import fused_int8
from diloco.algorithm.compression.codecs import (
    Codec,
    Encoded,
    Layout,
    decode,
    decode_into,
    encode,
    max_abs,
    piece_elements,
    read_elements,
)
from diloco.wire.compressed.bitpack import pack
from diloco.wire.compressed.header import (
    CODES,
    INDICES,
    META_CODEC,
    PARTS,
    SCALES,
    SEPARATOR,
    CompressedEntry,
    CompressedHeader,
    Expected,
    check_codec_metadata,
    check_compressed_header,
    codec_metadata,
    is_compressed,
    part_specs,
)
from diloco.wire.compressed.values import as_bytes, read_span
from diloco.wire.format.checks import check_finite
from diloco.wire.format.frames import decode_frame, encode_tensors
from diloco.wire.format.layout import FrameLayout
from diloco.wire.format.shard_layout import split_by_layout

# read(part, begin, end): the bytes [begin, end) of one part, counted from the part's first byte.
PartReader = Callable[[str, int, int], torch.Tensor | bytes | bytearray | memoryview]

__all__ = [
    "CODES",
    "INDICES",
    "PARTS",
    "SCALES",
    "SEPARATOR",
    "CompressedEntry",
    "CompressedHeader",
    "PartReader",
    "apply_delta",
    "check_codec_metadata",
    "check_compressed_header",
    "check_entry",
    "codec_metadata",
    "compressed_frame",
    "decode_compressed",
    "decode_entry",
    "encode_compressed",
    "fold_entry",
    "is_compressed",
    "part_specs",
    "read_span",
    "write_entry",
    "write_parts",
]


# ------------------------------------------------------------------ sending


def encode_compressed(
    tensors: Mapping[str, torch.Tensor],
    codec: Codec,
    exact: Collection[str] = frozenset(),
    *,
    fold_into: Mapping[str, torch.Tensor] | None = None,
    weight: float = 1.0,
    less: Mapping[str, torch.Tensor] | None = None,
    reuse: bytearray | None = None,
    staging: Callable[[int], torch.Tensor] | None = None,
) -> bytearray:
    """A safetensors body of `tensors`: floating ones not in `exact` coded by `codec` as parts,
    the others as plain entries (their own dtype). The codec is in the header's metadata.
    `fold_into` (name -> fp32 tensor): each gets weight * what its entry decodes to, as
    `write_parts` does (error feedback: the residual loses what was sent). `less` (name ->
    tensor of its shape): that coded entry is tensor - less, taken piece by piece as
    `write_parts` does (a worker's anchor - local). `reuse`: an earlier body that nobody
    reads any more (see `compressed_frame`).

    `staging(size)`: a 1-D uint8 tensor of `size` bytes, on the tensors' device, that nobody
    reads (its bytes between uses may be anything). The parts are coded into it, where the
    tensors live, and its data section is then copied to the body in one transfer: a GPU's
    pieces are coded without a blocking copy of each piece's codes and scales to the host.
    The body is byte for byte the one coded without it."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    layout = _compressed_layout(shapes, codec, exact)
    buffer, views = _frame(layout, reuse)
    staged = None
    if staging is not None and buffer:
        staged = staging(layout.size)
        if staged.dtype != torch.uint8 or staged.dim() != 1 or staged.numel() != layout.size:
            raise ValueError(f"staging must give a 1-D uint8 tensor of {layout.size} bytes")
        views = layout.views(staged)
    folds, lesses = fold_into or {}, less or {}
    for name, tensor in tensors.items():
        write_entry(
            views,
            name,
            tensor,
            codec,
            exact,
            fold_into=folds.get(name),
            weight=weight,
            less=lesses.get(name),
        )
    if staged is not None:  # the data section (every byte of it is some entry's), at once
        start = len(layout.header)
        torch.frombuffer(buffer, dtype=torch.uint8)[start:].copy_(staged[start:])
    return buffer


def _compressed_layout(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    codec: Codec,
    exact: Collection[str],
) -> FrameLayout:
    """The layout of a compressed body of `shapes`: each coded tensor's parts, the others
    plain, the codec in the metadata."""
    entries: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in shapes.items():
        if is_compressed(name, dtype, exact):
            for part, spec in part_specs(math.prod(shape), codec).items():
                entries[f"{name}{SEPARATOR}{part}"] = spec
        else:
            entries[name] = (tuple(shape), dtype)
    return FrameLayout.plan(entries, metadata=codec_metadata(codec))


def compressed_frame(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    codec: Codec,
    exact: Collection[str] = frozenset(),
    *,
    reuse: bytearray | None = None,
) -> tuple[bytearray, dict[str, torch.Tensor]]:
    """An empty body for tensors of `shapes` (name -> (shape, dtype)), its header written, and
    the views of its entries: fill it one tensor at a time with `write_entry`, so that a
    sender never needs every tensor to send at once (a server's deltas, one at a time).

    `reuse`: a body this function made for the same shapes and codec, that nobody reads any
    more; when its size is this body's it is written over instead of allocating, zero-filling
    and page-faulting a new one (about 0.07 s a round at 85M parameters). Once every entry is
    written the bytes are a new body's: the header and every part are written again, and the
    alignment padding between them was left zero by the first write."""
    return _frame(_compressed_layout(shapes, codec, exact), reuse)


def _frame(
    layout: FrameLayout, reuse: bytearray | None
) -> tuple[bytearray, dict[str, torch.Tensor]]:
    """`compressed_frame` for a planned layout: the body (`reuse` when its size fits), its
    header written, and its entries' views."""
    buffer = reuse if reuse is not None and len(reuse) == layout.size else bytearray(layout.size)
    body = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0)
    layout.write_header(body)
    return buffer, layout.views(body)


def write_entry(
    views: Mapping[str, torch.Tensor],
    name: str,
    tensor: torch.Tensor,
    codec: Codec,
    exact: Collection[str] = frozenset(),
    *,
    fold_into: torch.Tensor | None = None,
    weight: float = 1.0,
    less: torch.Tensor | None = None,
) -> None:
    """Write `tensor` into its entries of a `compressed_frame` body: coded parts, or plain
    (`fold_into`, `less`: see `write_parts`; coded entries only)."""
    if is_compressed(name, tensor.dtype, exact):
        parts = {part: views.get(f"{name}{SEPARATOR}{part}") for part in PARTS}
        write_parts(tensor, codec, parts, fold_into=fold_into, weight=weight, less=less)
    elif tensor.numel():
        views[name].copy_(tensor.detach())


def write_parts(
    x: torch.Tensor,
    codec: Codec,
    parts: Mapping[str, torch.Tensor | None],
    *,
    fold_into: torch.Tensor | None = None,
    weight: float = 1.0,
    less: torch.Tensor | None = None,
) -> None:
    """Code `x` into `parts` (1-D tensors of the shapes and dtypes of `part_specs`), piece by
    piece, so that no full-size temporary is made.

    `fold_into` (contiguous fp32, x's size; may be x itself): += weight * each piece's decoded
    values, with the very `decode_into` of each piece that a receiver's `fold_entry` runs on
    the same span, so a sender's copy moves bit for bit as a receiver's does, without reading
    the body back (the server's published weights; a worker's error-feedback residual).

    `less` (x's size; may be `fold_into`): code x - less, each piece's difference taken just
    before the piece is coded (and before `fold_into` moves there), in one piece-sized
    buffer: the same fp32 subtraction as a whole-tensor difference, without its tensor-sized
    temporary and the pass that writes it out and reads it back (a server's delta to P; a
    worker's anchor - local). A `less` of another dtype or device is converted a piece at a
    time (to fp32 on x's device, as `pseudo_gradient` converts the whole tensor); one that is
    not contiguous is flattened once."""
    flat = x.detach().reshape(-1)
    codes = parts[CODES]
    assert codes is not None
    folded = fold_into.view(-1) if fold_into is not None else None
    if less is not None and less.shape != x.shape:
        raise ValueError(f"less must have x's shape {tuple(x.shape)}, got {tuple(less.shape)}")
    layout = Layout(flat.numel(), codec)
    size = min(flat.numel(), max(piece_elements(flat.device), layout.group_elements))
    scratch = torch.empty(size if less is not None else 0, dtype=torch.float32, device=flat.device)
    less_flat = less.detach().reshape(-1) if less is not None else None

    def values(start: int, stop: int) -> torch.Tensor:
        if less_flat is None:
            return flat[start:stop]
        other = less_flat[start:stop].to(device=flat.device, dtype=torch.float32)
        return torch.sub(flat[start:stop], other, out=scratch[: stop - start])

    if not codec.is_quantized and not codec.is_sparse:  # fp32 / bf16: a (casting) copy
        if less is None:
            codes.copy_(flat)
        else:
            for span in layout.spans(piece_elements(flat.device)):
                codes[span.start : span.stop].copy_(values(span.start, span.stop))
        if folded is not None:  # what the receiver decodes: the codes, as fp32
            folded.add_(codes.to(folded.device).float(), alpha=weight)
        return
    scales, indices = parts.get(SCALES), parts.get(INDICES)
    # 8-bit levels are their own packing: a dense int8 piece is coded straight into its slots
    # (when they are on x's device; a GPU's pieces are coded there and copied to the body)
    direct = codec.bits == 8 and not codec.is_sparse and codes.device == flat.device
    for span in layout.spans(piece_elements(flat.device)):
        target = folded[span.start : span.stop] if folded is not None else None
        slots = None
        if direct:
            assert scales is not None
            slots = Encoded(span.numel, codes[slice(*span.code_bytes)], scales[slice(*span.blocks)])
            fused = less_flat is not None and (target is None or weight == 1.0)
            if fused and fused_int8.code(
                flat[span.start : span.stop],
                less_flat[span.start : span.stop],
                slots.codes,
                slots.scales,
                codec.block,
                fold_into=target,
            ):
                continue  # the fused kernel's bytes are these (see fused_int8)
        piece = encode(
            values(span.start, span.stop), codec, out=slots, fold_into=target, weight=weight
        )
        if direct:
            continue
        if codec.is_quantized:
            assert scales is not None and piece.scales is not None
            pack(piece.codes, codec.bits, out=codes[slice(*span.code_bytes)])
            scales[slice(*span.blocks)].copy_(piece.scales)
        else:
            codes[slice(*span.values)].copy_(piece.codes)
        if codec.is_sparse:
            assert indices is not None and piece.indices is not None
            pack(piece.indices, codec.index_bits, out=indices[slice(*span.index_bytes)])


# ------------------------------------------------------------------ receiving a body in memory


def decode_compressed(
    buffer: bytes | bytearray | memoryview,
    expected: Expected,
    codec: Codec,
    *,
    exact: Collection[str] = frozenset(),
    require_all: bool = True,
) -> dict[str, torch.Tensor]:
    """Check and decode a compressed body in memory: compressed tensors come back as fp32 of
    their expected shape, plain ones as views of `buffer` (floating ones checked finite).
    Everything is checked before anything is returned; WireError(422) otherwise."""
    tensors, metadata = decode_frame(buffer)
    header = check_compressed_header(
        tensors, metadata, expected, codec, exact=exact, require_all=require_all
    )
    result: dict[str, torch.Tensor] = {}
    for name, entry in header.compressed.items():
        part_bytes = {part: as_bytes(tensor) for part, tensor in entry.parts.items()}
        result[name] = decode_entry(
            entry, lambda part, begin, end, raw=part_bytes: raw[part][begin:end]
        )
    for name, tensor in header.plain.items():
        check_finite(name, tensor)
        result[name] = tensor
    return {name: result[name] for name in expected if name in result}


def apply_delta(
    buffer: bytes | bytearray | memoryview,
    targets: Mapping[str, torch.Tensor],
    codec: Codec,
    *,
    exact: Collection[str] = frozenset(),
    scratch: bool = False,
) -> None:
    """Apply a delta body to `targets` (name -> tensor, updated in place): every coded tensor
    is added (target += D(parts), span by span with `fold_entry`), every plain one replaces
    its target. The body must name exactly the targets. Everything is checked before any
    target changes (WireError 422), so a refused body leaves the targets as they were;
    `scratch` targets (copies, dropped on a refusal) are checked span by span as they are
    moved instead, sparing a pass over the body.

    A server and its workers both move their copies of the published weights with this one
    function: the same fp32 additions in the same order, hence bit-identical copies."""
    tensors, metadata = decode_frame(buffer)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in targets.items()}
    header = check_compressed_header(tensors, metadata, expected, codec, exact=exact)
    readers = {}
    for name, entry in header.compressed.items():
        part_bytes = {part: as_bytes(tensor) for part, tensor in entry.parts.items()}
        readers[name] = lambda part, begin, end, raw=part_bytes: raw[part][begin:end]
        if not scratch:
            check_entry(entry, readers[name])
    for name, tensor in header.plain.items():
        if tensor.is_floating_point():
            check_finite(name, tensor)
    for name, entry in header.compressed.items():
        fold_entry(entry, readers[name], targets[name])
    for name, tensor in header.plain.items():
        targets[name].copy_(tensor)


def decode_entry(entry: CompressedEntry, read: PartReader) -> torch.Tensor:
    """The fp32 tensor of `entry`, span by span: `read(part, begin, end)` gives the bytes
    [begin, end) of a part (from the part's first byte)."""
    codec = entry.layout.codec
    out = torch.empty(entry.shape, dtype=torch.float32)
    flat = out.view(-1)
    for span in entry.layout.spans(read_elements(codec, flat.device)):
        ranges = entry.part_ranges(span)
        parts = {part: read(part, begin, end) for part, (begin, end) in ranges.items()}
        decode(read_span(entry, span, parts), codec, out=flat[span.start : span.stop])
    return out


def check_entry(entry: CompressedEntry, read: PartReader) -> float:
    """Check every span of `entry` (as `read_span` does) without decoding it; returns a bound
    of every decoded magnitude (codecs.max_abs), for an overflow check before folding."""
    bound = 0.0
    for span in entry.layout.spans(read_elements(entry.layout.codec, torch.device("cpu"))):
        parts = {part: read(part, *where) for part, where in entry.part_ranges(span).items()}
        bound = max(bound, max_abs(read_span(entry, span, parts), entry.layout.codec))
    return bound


def fold_entry(
    entry: CompressedEntry, read: PartReader, target: torch.Tensor, weight: float = 1.0
) -> None:
    """target += weight * the decoded tensor, span by span, each span checked before it is
    added (`target`: contiguous fp32 of the tensor's size, any shape). A refusal part way
    leaves the spans before it added: run `check_entry` first unless `target` is scratch.
    `target` may live on an accelerator: each span's parts are decoded next to it."""
    codec = entry.layout.codec
    flat = target.view(-1)
    for span in entry.layout.spans(read_elements(codec, flat.device)):
        parts = {part: read(part, *where) for part, where in entry.part_ranges(span).items()}
        piece = read_span(entry, span, parts).to(flat.device)
        decode_into(piece, codec, flat[span.start : span.stop], weight)


# ------------------------------------------------------------------ cutting a body for shards


def split_body(
    body: bytes | bytearray | memoryview, layout: Sequence[Sequence[str]]
) -> list[bytearray]:
    """A body cut into each shard's body by the tensor names of `layout` (sharded servers).

    A compressed body's parts ("w#codes", "w#scales", ...) go with their tensor ("w"), and
    every shard's body keeps the header's metadata (the codec): a codec codes each tensor on
    its own, so each shard gets byte for byte the body its tensors alone would have been
    coded into. A plain body's tensors go as `encode_tensors` would write them. A name the
    layout lacks, or one it names and the body lacks, is a ValueError naming it."""
    entries, metadata = decode_frame(body)
    coded = META_CODEC in metadata
    by_tensor: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in entries.items():
        base, separator, part = name.rpartition(SEPARATOR)
        owner = base if coded and separator and part in PARTS else name
        by_tensor.setdefault(owner, {})[name] = tensor
    return [
        encode_tensors(
            {name: t for group in owned.values() for name, t in group.items()},  # type: ignore[attr-defined]
            metadata=metadata if coded else None,
        )
        for owned in split_by_layout(by_tensor, layout)  # type: ignore[arg-type]
    ]


def join_bodies(bodies: Sequence[bytes | bytearray | memoryview]) -> bytearray:
    """The shards' bodies as one (`split_body`'s inverse): every entry of each, under the
    header metadata they share (a coded delta's codec; none for plain weights). Bodies whose
    metadata differ, or that name one entry twice, are a ValueError."""
    joined: dict[str, torch.Tensor] = {}
    shared: dict[str, str] | None = None
    for body in bodies:
        entries, metadata = decode_frame(body)
        if shared is not None and metadata != shared:
            raise ValueError(
                f"the shards' bodies disagree on their metadata: {shared} and {metadata}"
            )
        shared = metadata
        twice = sorted(set(entries) & set(joined))
        if twice:
            raise ValueError(f"entry {twice[0]!r} came from two shards")
        joined.update(entries)
    return encode_tensors(joined, metadata=shared or None)
