"""Compressed bodies (wire/compressed/body.py, wire/compressed/bitpack.py): the bytes of
docs/protocol.md's worked examples, round trips, every malformed case, and fuzzing. Expected
bytes are worked out by hand in the test."""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.algorithm.compression.codecs import (
    Codec,
    Layout,
    decode,
    encode,
    parse_codec,
    piece_elements,
)
from diloco.wire import WireError, decode_tensors, encode_tensors
from diloco.wire.compressed.bitpack import pack, padding_is_zero, unpack
from diloco.wire.compressed.body import (
    apply_delta,
    check_codec_metadata,
    check_compressed_header,
    check_entry,
    codec_metadata,
    decode_compressed,
    decode_entry,
    encode_compressed,
    fold_entry,
    read_span,
    write_parts,
)
from diloco.wire.compressed.header import part_specs
from diloco.wire.format.frames import decode_frame, read_frame_header
from frames import frame_of

INT2_8 = Codec("int2", block=8)
TOPK_HALF = Codec("int2", 0.5, block=8, chunk=4)


def expect(shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
    return (shape, dtype)


def body_of(entries: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytearray:
    """A body of exactly these entries (already coded parts, or plain tensors)."""
    return frame_of(entries, metadata)


def parts_of(body: bytearray) -> dict[str, torch.Tensor]:
    """The entries of a body as copies, to be changed and written again with `body_of`."""
    tensors, _ = decode_frame(body)
    return {name: tensor.clone() for name, tensor in tensors.items()}


def refused(body: bytes | bytearray, expected: dict, codec: Codec, **kwargs) -> WireError:
    with pytest.raises(WireError) as caught:
        decode_compressed(body, expected, codec, **kwargs)
    assert caught.value.status == 422
    return caught.value


# ------------------------------------------------------------------ the documented bytes


def test_the_int2_example_of_the_protocol_doc_byte_for_byte() -> None:
    x = torch.tensor([3, -3, 0, 1, -1, 0.9, -2.0, 2.0])
    body = encode_compressed({"w": x}, INT2_8)
    header = (
        b'{"__metadata__":{"diloco.codec":"int2","diloco.block":"8","diloco.chunk":"128",'
        b'"diloco.k":"0"},"w#scales":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"w#codes":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}'
    )
    assert len(header) == 213
    expected = (
        bytes.fromhex("d800000000000000")
        + header
        + b"   "
        + bytes.fromhex("00000040")  # the scale 2.0
        + bytes.fromhex("a3d9")  # levels 3, 0, 2, 2 | 1, 2, 1, 3 at 2 bits
    )
    assert bytes(body) == expected
    decoded = decode_compressed(expected, {"w": expect((8,))}, INT2_8)
    assert decoded["w"].tolist() == [3, -3, 1, 1, -1, 1, -1, 3]


def test_the_topk_example_of_the_protocol_doc() -> None:
    x = torch.tensor([1, -6, 3, 2, 0.5, 0, -1.5, 6])
    body = encode_compressed({"w": x}, TOPK_HALF)
    tensors, metadata = decode_frame(body)
    assert metadata == {
        "diloco.codec": "topk:0.5+int2",
        "diloco.block": "8",
        "diloco.chunk": "4",
        "diloco.k": "2",
    }
    assert bytes(tensors["w#codes"].numpy()) == b"\xd8"
    assert bytes(tensors["w#scales"].numpy()) == bytes.fromhex("00008040")
    assert bytes(tensors["w#indices"].numpy()) == b"\xe9"
    decoded = decode_compressed(body, {"w": expect((8,))}, TOPK_HALF)
    assert decoded["w"].tolist() == [0, -6, 2, 0, 0, 0, -2, 6]


# ------------------------------------------------------------------ bit packing


@pytest.mark.parametrize(
    ("values", "bits", "packed"),
    [
        ([1, 0, 1, 1, 0, 0, 0, 0, 1], 1, [0b00001101, 1]),
        ([1, 2, 3], 4, [0x21, 0x03]),
        ([3, 0, 2, 2, 1], 2, [0xA3, 0x01]),
        ([200, 7], 8, [200, 7]),
        # 7 bits: 1 in bits 0-6; 127 in bits 7-13; 0 in 14-20; 5 (101b) in bits 21-27
        ([1, 127, 0, 5], 7, [1 | 1 << 7, 63, 1 << 5 | 1 << 7, 0]),
        ([0xABC, 0x123], 12, [0xBC, 0x3A, 0x12]),
        ([0x1FF, 1], 9, [0xFF, 0b11, 0]),
        ([0xFFFF, 0x1234], 16, [0xFF, 0xFF, 0x34, 0x12]),
    ],
)
def test_packing_by_hand(values: list[int], bits: int, packed: list[int]) -> None:
    dtype = torch.uint8 if bits <= 8 else torch.int64
    result = pack(torch.tensor(values, dtype=dtype), bits)
    assert result.tolist() == packed
    assert unpack(result, bits, len(values)).tolist() == values


def _reference_pack(values: list[int], bits: int) -> bytes:
    """The protocol's definition, bit by bit."""
    out = bytearray(-(-len(values) * bits // 8))
    for i, value in enumerate(values):
        for b in range(bits):
            if value >> b & 1:
                out[(i * bits + b) // 8] |= 1 << ((i * bits + b) % 8)
    return bytes(out)


@pytest.mark.parametrize("bits", range(1, 17))
def test_every_width_packs_as_the_bitwise_definition(bits: int) -> None:
    rng = random.Random(bits)
    for count in (0, 1, 2, 7, 8, 9, 31, 64, 100):
        values = [rng.randrange(1 << bits) for _ in range(count)]
        dtype = torch.uint8 if bits <= 8 else torch.int64
        packed = pack(torch.tensor(values, dtype=dtype), bits)
        assert bytes(packed.numpy()) == _reference_pack(values, bits)
        assert unpack(packed, bits, count).tolist() == values
        assert padding_is_zero(packed, bits, count)


def test_padding_bits_are_seen() -> None:
    assert not padding_is_zero(torch.tensor([0b0100_0000], dtype=torch.uint8), 2, 3)
    assert padding_is_zero(torch.tensor([0b0011_1111], dtype=torch.uint8), 2, 3)


# ------------------------------------------------------------------ round trips

SPECS = [
    "fp32",
    "bf16",
    "int8",
    "int4",
    "int2",
    "topk:0.03+int2",
    "topk:0.01+int2",
    "topk:0.3",
    "topk:0.5+bf16",
    "topk:0.2+int8",
    "topk:1.0+int4",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(("block", "chunk"), [(128, 128), (8, 4096), (64, 512)])
def test_round_trip_of_odd_shapes(spec: str, block: int, chunk: int) -> None:
    codec = parse_codec(spec, block=block, chunk=chunk)
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "a": torch.randn(3, 1001, generator=generator),
        "empty": torch.zeros(0, 4),
        "one": torch.tensor([0.75]),
        "half": torch.randn(70_001, generator=generator).bfloat16(),
        "step": torch.tensor(3),
        "mask": torch.tensor([True, False]),
    }
    body = encode_compressed(tensors, codec)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    decoded = decode_compressed(body, expected, codec)
    assert list(decoded) == list(tensors)
    assert decoded["step"].item() == 3 and decoded["mask"].tolist() == [True, False]
    for name in ("a", "empty", "one", "half"):
        x = tensors[name].float()
        got = decoded[name]
        assert got.shape == x.shape and got.dtype == torch.float32
        assert torch.equal(got, decode(encode(x, codec), codec).view(x.shape))
        _within_codec_error(x.reshape(-1), got.reshape(-1), codec)
    # the wire size is the codec's: parts only, plus the plain tensors
    data = len(body) - 8 - int.from_bytes(body[:8], "little")
    parts = sum(Layout(t.numel(), codec).nbytes for t in tensors.values() if t.is_floating_point())
    assert data == parts + 8 + 2


def _within_codec_error(x: torch.Tensor, got: torch.Tensor, codec: Codec) -> None:
    """Each decoded value is within the codec's own error of its input: half a step of its
    block's scale (int8 / int4), one step (int2), bf16's half ulp; top-k values are elsewhere 0."""
    if x.numel() == 0:
        return
    if codec.is_sparse:
        kept = got != 0
        assert int(kept.sum()) <= Layout(x.numel(), codec).values
        x, got = x[kept], got[kept]
        if codec.is_quantized:  # the kept values' blocks are not x's blocks: a loose bound
            assert bool((got.abs() <= x.abs().max() * (1 + 1e-6)).all())
            return
    if codec.values == "fp32":
        assert torch.equal(got, x)
    elif codec.values == "bf16":
        assert bool(((got - x).abs() <= x.abs() * 2**-8).all())
    else:
        step = {"int8": 1 / 127, "int4": 1 / 7, "int2": 1 / 1.5}[codec.values]
        slack = 0.5 if codec.values != "int2" else 1.0
        count = x.numel()
        padded = torch.zeros(-(-count // codec.block) * codec.block)
        padded[:count] = x.abs()
        bound = padded.view(-1, codec.block).amax(1).repeat_interleave(codec.block)[:count]
        assert bool(((got - x).abs() <= bound * step * slack * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("spec", ["int8", "int2", "topk:0.25+int4", "topk:0.5"])
def test_a_body_written_over_an_old_one_is_byte_for_byte_a_new_one(spec: str) -> None:
    """`reuse`: the old body's bytes (other values, the same shapes) are all written over,
    padding included; a body of another size is not reused."""
    codec = parse_codec(spec, block=8, chunk=8)
    generator = torch.Generator().manual_seed(5)

    def tensors(scale: float) -> dict[str, torch.Tensor]:
        return {
            "w": torch.randn(3, 7, generator=generator) * scale,  # a short last block and chunk
            "b": torch.randn(5, generator=generator),
            "steps": torch.tensor([3, -1], dtype=torch.int64),
            "norm": torch.randn(3, generator=generator),
        }

    old = encode_compressed(tensors(1e6), codec, exact={"norm"})
    new = tensors(1e-3)
    fresh = encode_compressed(new, codec, exact={"norm"})
    reused = encode_compressed(new, codec, exact={"norm"}, reuse=old)
    assert reused is old and reused == fresh
    other = encode_compressed({"w": torch.randn(9)}, codec, reuse=old)
    assert other is not old and len(other) != len(old)


@pytest.mark.parametrize(
    ("spec", "block", "chunk"),
    [
        ("int8", 128, 128),
        ("int4", 128, 128),
        ("int2", 128, 128),
        ("topk:0.03+int2", 128, 128),
        ("topk:0.1", 128, 128),
        ("topk:0.03+int8", 512, 2048),  # one group of 1M elements: more than a CPU piece
        ("bf16", 128, 128),
        ("fp32", 128, 128),
    ],
)
def test_coding_x_less_p_piece_by_piece_is_coding_the_whole_difference(
    spec: str, block: int, chunk: int
) -> None:
    """`less`: x - P taken a piece at a time (P moving as each piece is coded) gives the body
    and the moved P that coding the whole difference x - P, made first, gives, bit for bit,
    across several pieces and a short last block (or one group larger than a piece)."""
    codec = parse_codec(spec, block=block, chunk=chunk)
    generator = torch.Generator().manual_seed(11)
    numel = 2 * piece_elements(torch.device("cpu")) + 77  # three pieces, the last block short
    x = torch.randn(numel, generator=generator)
    p = x + 1e-3 * torch.randn(numel, generator=generator)

    def body(moved: torch.Tensor, less: torch.Tensor | None) -> bytes:
        parts = {
            part: torch.zeros(math.prod(shape), dtype=dtype)
            for part, (shape, dtype) in part_specs(numel, codec).items()
        }
        source = x if less is not None else x - moved
        write_parts(source, codec, parts, fold_into=moved, less=less)
        return b"".join(bytes(t.view(torch.uint8).numpy()) for t in parts.values())

    whole_p, piece_p = p.clone(), p.clone()
    assert body(whole_p, None) == body(piece_p, piece_p)
    assert torch.equal(whole_p, piece_p) and not torch.equal(piece_p, p)


def test_coding_x_less_a_tensor_of_another_shape_is_refused() -> None:
    codec = parse_codec("int8")
    parts = {
        part: torch.zeros(math.prod(s), dtype=d) for part, (s, d) in part_specs(8, codec).items()
    }
    with pytest.raises(ValueError, match=r"less must have x's shape \(8,\), got \(9,\)"):
        write_parts(torch.ones(8), codec, parts, less=torch.ones(9))
    assert all(not bool(t.any()) for t in parts.values())  # nothing written


@pytest.mark.parametrize("spec", ["int8", "topk:0.25+int2", "fp32"])
def test_a_body_cut_for_shards_is_each_shard_s_own_body_byte_for_byte(spec: str) -> None:
    """split_body: each shard's part is the body its tensors alone are coded into (codec
    metadata kept, a tensor's parts together, a plain entry with its tensor); a name the
    layout lacks is a ValueError naming it."""
    from diloco.wire.compressed.body import split_body

    codec = parse_codec(spec, block=8, chunk=8)
    generator = torch.Generator().manual_seed(9)
    tensors = {
        "a#b": torch.randn(30, generator=generator),  # a '#' in a tensor's own name
        "w": torch.randn(4, 5, generator=generator),
        "norm": torch.randn(3, generator=generator),
        "steps": torch.tensor([2, 7]),
    }
    layout = [["w", "steps"], ["a#b", "norm"]]

    def body_of(names: list[str]) -> bytearray:
        part = {n: tensors[n] for n in names}
        if codec.is_identity:
            return encode_tensors(part)
        return encode_compressed(part, codec, exact={"norm"} & set(names))

    whole = body_of(["a#b", "w", "norm", "steps"])
    assert split_body(whole, layout) == [body_of(names) for names in layout]
    with pytest.raises(ValueError, match="tensor 'norm' is owned by no shard"):
        split_body(whole, [["w", "steps"], ["a#b"]])


def test_exact_tensors_keep_their_plain_entry() -> None:
    tensors = {"w": torch.randn(20), "norm": torch.tensor([1.25, -3.0])}
    body = encode_compressed(tensors, INT2_8, exact={"norm"})
    names = set(decode_frame(body)[0])
    assert names == {"w#codes", "w#scales", "norm"}
    expected = {"w": expect((20,)), "norm": expect((2,))}
    decoded = decode_compressed(body, expected, INT2_8, exact={"norm"})
    assert decoded["norm"].tolist() == [1.25, -3.0]


def test_a_body_decodes_piece_by_piece_from_a_file(tmp_path) -> None:
    """The server's path: header from the file's start, then each span's byte ranges."""
    codec = parse_codec("topk:0.03+int2")
    x = torch.randn(300_000)
    body = encode_compressed({"w": x, "b": torch.randn(5)}, codec)
    path = tmp_path / "body"
    path.write_bytes(body)
    with open(path, "rb") as file:
        data_start, entries, metadata = read_frame_header(file.read(4096), len(body))
        header = check_compressed_header(
            entries, metadata, {"w": expect((300_000,)), "b": expect((5,))}, codec
        )
        entry = header.compressed["w"]
        total = torch.zeros(300_000)
        for span in entry.layout.spans(20_000):
            ranges = entry.data_ranges(span)
            parts = {
                part: os.pread(file.fileno(), end - begin, data_start + begin)
                for part, (begin, end) in ranges.items()
            }
            piece = read_span(entry, span, parts)
            total[span.start : span.stop] = decode(piece, codec)
    assert torch.equal(
        total, decode_compressed(body, {"w": expect((300_000,)), "b": expect((5,))}, codec)["w"]
    )


def test_decode_entry_reads_parts_through_a_callback() -> None:
    body = encode_compressed({"w": torch.arange(10.0)}, INT2_8)
    tensors, metadata = decode_frame(body)
    header = check_compressed_header(tensors, metadata, {"w": expect((10,))}, INT2_8)
    raw = {part: t.view(torch.uint8) for part, t in header.compressed["w"].parts.items()}
    decoded = decode_entry(header.compressed["w"], lambda part, b, e: raw[part][b:e])
    # block 0: s = 7 / 1.5; block 1 ([8, 9]): s = 6
    assert decoded[8:].tolist() == [9.0, 9.0]


def test_check_entry_bounds_and_fold_entry_adds_weighted_values() -> None:
    body = encode_compressed({"w": torch.tensor([3, -3, 0, 1, -1, 0.9, -2.0, 2.0])}, INT2_8)
    tensors, metadata = decode_frame(body)
    entry = check_compressed_header(tensors, metadata, {"w": expect((8,))}, INT2_8).compressed["w"]
    raw = {part: t.view(torch.uint8) for part, t in entry.parts.items()}

    def read(part: str, begin: int, end: int) -> torch.Tensor:
        return raw[part][begin:end]

    assert check_entry(entry, read) == 3.0  # 1.5 x the scale 2
    target = torch.ones(2, 4)
    fold_entry(entry, read, target, weight=0.5)
    # 1 + 0.5 x [3, -3, 1, 1, -1, 1, -1, 3]
    assert target.view(-1).tolist() == [2.5, -0.5, 1.5, 1.5, 0.5, 1.5, 0.5, 2.5]
    raw["scales"] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(WireError, match="block 0 has scale nan"):
        check_entry(entry, read)


def test_the_frame_parser_gives_the_metadata_back_and_old_callers_still_work() -> None:
    body = encode_compressed({"w": torch.ones(3)}, INT2_8)
    assert decode_frame(body)[1] == codec_metadata(INT2_8)
    assert set(decode_tensors(body)) == {"w#codes", "w#scales"}
    plain = encode_tensors({"w": torch.ones(3)})
    assert decode_frame(plain)[1] == {}


# ------------------------------------------------------------------ malformed bodies


def test_another_codec_is_a_codec_mismatch_naming_both() -> None:
    body = encode_compressed({"w": torch.ones(16)}, Codec("int8", block=8))
    error = refused(body, {"w": expect((16,))}, Codec("int4", block=8))
    assert error.kind == "codec_mismatch"
    assert "coded as 'int8' (block 8, chunk 128, k 0)" in error.error
    assert "the receiver expects 'int4' (block 8, chunk 128, k 0)" in error.error
    error = refused(body, {"w": expect((16,))}, Codec("int8", block=16))
    assert error.kind == "codec_mismatch" and "block 16" in error.error


def test_a_plain_body_has_no_codec() -> None:
    error = refused(encode_tensors({"w": torch.ones(4)}), {"w": expect((4,))}, INT2_8)
    assert error.kind == "codec_mismatch" and "no codec" in error.error


def test_a_tampered_k_is_a_codec_mismatch() -> None:
    parts = parts_of(encode_compressed({"w": torch.ones(8)}, TOPK_HALF))
    metadata = {**codec_metadata(TOPK_HALF), "diloco.k": "3"}
    error = refused(body_of(parts, metadata), {"w": expect((8,))}, TOPK_HALF)
    assert error.kind == "codec_mismatch" and "(block 8, chunk 4, k 3)" in error.error


def _mutated(
    tensors: dict[str, torch.Tensor],
    codec: Codec,
    change: Callable[[dict[str, torch.Tensor]], None],
) -> bytearray:
    parts = parts_of(encode_compressed(tensors, codec))
    change(parts)
    return body_of(parts, codec_metadata(codec))


def _malformed(body: bytearray, expected: dict, codec: Codec, *pieces: str, **detail) -> None:
    error = refused(body, expected, codec)
    assert error.kind == "malformed_compressed", error.error
    for piece in pieces:
        assert piece in error.error, error.error
    for key, value in detail.items():
        assert error.detail[key] == value, error.detail


W20 = {"w": torch.linspace(-1, 1, 20)}
E20 = {"w": expect((20,))}


def test_a_wrong_block_count_names_the_tensor_and_the_part() -> None:
    def drop_scale(parts):
        parts["w#scales"] = parts["w#scales"][:2]

    _malformed(
        _mutated(W20, INT2_8, drop_scale),
        E20,
        INT2_8,
        "tensor 'w' part 'scales' is F32 [2], expected F32 [3]",
        "one fp32 scale per block of 8 of 20 coded values",
        tensor="w",
        part="scales",
    )


def test_truncated_packing_names_the_part() -> None:
    def truncate(parts):
        parts["w#codes"] = parts["w#codes"][:-1]

    _malformed(
        _mutated(W20, INT2_8, truncate),
        E20,
        INT2_8,
        "tensor 'w' part 'codes' is U8 [4], expected U8 [5]",
        tensor="w",
        part="codes",
    )


def test_truncated_indices_name_the_part() -> None:
    def truncate(parts):
        parts["w#indices"] = parts["w#indices"][:-1]

    codec = Codec("int2", 0.5, block=8, chunk=4)
    _malformed(_mutated(W20, codec, truncate), E20, codec, "part 'indices'", part="indices")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (float("nan"), "scales must be finite and >= 0"),
        (float("inf"), "scales must be finite and >= 0"),
        (-1.0, "scales must be finite and >= 0"),
        (-1.401298464324817e-45, "scales must be finite and >= 0"),  # the least negative
        (float("-inf"), "scales must be finite and >= 0"),
        (3e38, "would decode to Inf"),
    ],
)
def test_bad_scales_name_the_tensor_and_the_block(value: float, reason: str) -> None:
    def spoil(parts):
        parts["w#scales"][1] = value

    _malformed(
        _mutated(W20, Codec("int8", block=8), spoil),
        E20,
        Codec("int8", block=8),
        "tensor 'w' part 'scales': block 1",
        reason,
        block=1,
    )


@pytest.mark.parametrize("values", ["int8", "int4", "int2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_sender_s_nan_or_inf_is_refused_by_its_scale(values: str, bad: float) -> None:
    """A block holding NaN or Inf has a non-finite scale and unspecified codes (any level, one
    past the range too): the receiver names the block by its scale, whatever its codes."""
    x = torch.linspace(-1, 1, 20)
    x[9] = bad  # block 1 of 8
    codec = Codec(values, block=8)
    body = encode_compressed({"w": x}, codec)
    _malformed(body, E20, codec, "part 'scales': block 1", "finite and >= 0", part="scales")


@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_a_zero_scale_needs_zero_level_codes_in_int8_and_int4(zero: float) -> None:
    for codec, zero_level in ((Codec("int8", block=8), 127), (Codec("int4", block=8), 7)):

        def spoil(parts):
            parts["w#scales"][2] = zero

        body = _mutated(W20, codec, spoil)
        _malformed(body, E20, codec, "block 2 has scale 0", f"zero level {zero_level}", block=2)
    # int2 with a zero scale decodes every level to 0: allowed
    body = _mutated(W20, INT2_8, lambda parts: parts["w#scales"].__setitem__(2, 0.0))
    assert decode_compressed(body, E20, INT2_8)["w"][16:].abs().sum() == 0


@pytest.mark.parametrize(("values", "level"), [("int8", 255), ("int4", 15)])
def test_a_level_past_the_range_is_refused(values: str, level: int) -> None:
    codec = Codec(values, block=8)

    def spoil(parts):
        if values == "int8":
            parts["w#codes"][5] = 255
        else:
            parts["w#codes"][2] = parts["w#codes"][2] | 0xF0  # value 5 is the high nibble

    _malformed(
        _mutated(W20, codec, spoil),
        E20,
        codec,
        f"holds level {level} at value 5",
        f"{values} levels are 0..{level - 1}",
        value=5,
    )


def test_non_zero_padding_bits_are_refused() -> None:
    def spoil(parts):
        parts["w#codes"][-1] |= 0b1000_0000  # 10 values at 2 bits: bits 0-3 of byte 2 used

    w10 = {"w": torch.linspace(-1, 1, 10)}
    body = _mutated(w10, INT2_8, spoil)
    _malformed(body, {"w": expect((10,))}, INT2_8, "non-zero padding bits", part="codes")
    codec = Codec("fp32", 0.5, chunk=8)  # k = 4; 20 elements: 3 chunks, 4 + 4 + 4 = 12 values

    def spoil_indices(parts):  # 12 indices at 3 bits: 36 bits, bits 4-7 of byte 4 unused
        parts["w#indices"][-1] |= 0b0001_0000

    _malformed(_mutated(W20, codec, spoil_indices), E20, codec, "padding", part="indices")


def _indices_body(indices: list[int], numel: int, codec: Codec) -> bytearray:
    """A top-k (fp32 values) body of one tensor with these chunk-local indices."""
    values = torch.ones(len(indices))
    packed = pack(torch.tensor(indices, dtype=torch.uint8), codec.index_bits)
    return body_of({"w#codes": values, "w#indices": packed}, codec_metadata(codec))


def test_a_duplicate_index_within_a_chunk_is_refused() -> None:
    codec = Codec("fp32", 0.5, chunk=4)  # k = 2
    good = _indices_body([0, 3, 1, 2], 8, codec)
    assert decode_compressed(good, {"w": expect((8,))}, codec)["w"].tolist() == [
        1,
        0,
        0,
        1,
        0,
        1,
        1,
        0,
    ]
    body = _indices_body([0, 3, 2, 2], 8, codec)
    _malformed(body, {"w": expect((8,))}, codec, "repeats index 2 in chunk 1", chunk=1)


def test_indices_must_ascend_within_a_chunk() -> None:
    codec = Codec("fp32", 0.5, chunk=4)
    body = _indices_body([3, 0, 1, 2], 8, codec)
    _malformed(body, {"w": expect((8,))}, codec, "is not ascending at index 0 in chunk 0")


def test_an_index_past_the_tail_chunk_is_refused() -> None:
    codec = Codec("fp32", 0.5, chunk=4)  # 6 elements: chunk 0, and a tail of 2
    body = _indices_body([0, 1, 0, 2], 6, codec)
    _malformed(
        body,
        {"w": expect((6,))},
        codec,
        "holds index 2 in chunk 1, the tail chunk of 2 elements",
        chunk=1,
    )


def test_non_finite_fp32_values_are_refused() -> None:
    codec = Codec("fp32", 0.5, chunk=4)
    body = _mutated(
        {"w": torch.arange(8.0)}, codec, lambda p: p["w#codes"].__setitem__(3, float("inf"))
    )
    _malformed(body, {"w": expect((8,))}, codec, "holds inf at value 3", part="codes")


def test_parts_must_match_what_the_codec_sends() -> None:
    def drop(parts):
        del parts["w#scales"]

    _malformed(_mutated(W20, INT2_8, drop), E20, INT2_8, "lacks its part w#scales", part="scales")

    def extra(parts):
        parts["w#indices"] = torch.zeros(1, dtype=torch.uint8)

    _malformed(_mutated(W20, INT2_8, extra), E20, INT2_8, "does not send", part="indices")

    def unknown(parts):
        parts["w#extra"] = torch.zeros(1, dtype=torch.uint8)

    _malformed(_mutated(W20, INT2_8, unknown), E20, INT2_8, "unknown part 'w#extra'")

    def wrong_dtype(parts):
        parts["w#scales"] = parts["w#scales"].double()

    _malformed(_mutated(W20, INT2_8, wrong_dtype), E20, INT2_8, "is F64 [3], expected F32 [3]")


def test_plain_and_compressed_may_not_be_swapped() -> None:
    plain = body_of({"w": torch.ones(20)}, codec_metadata(INT2_8))
    _malformed(plain, E20, INT2_8, "must be sent compressed as int2", tensor="w")
    body = encode_compressed({"w": torch.ones(20)}, INT2_8)
    error = refused(body, E20, INT2_8, exact={"w"})
    assert error.kind == "malformed_compressed" and "sent exact" in error.error


def test_names_shapes_and_dtypes_of_plain_entries() -> None:
    tensors = {"w": torch.ones(20), "step": torch.tensor([1])}
    body = encode_compressed(tensors, INT2_8)
    assert refused(body, E20, INT2_8).kind == "unknown_tensor"
    error = refused(body, {**E20, "step": expect((1,), torch.int64), "x": expect((2,))}, INT2_8)
    assert error.kind == "missing_tensor" and error.detail["tensor"] == "x"
    error = refused(body, {**E20, "step": expect((2,), torch.int64)}, INT2_8)
    assert error.kind == "wrong_shape"
    error = refused(body, {**E20, "step": expect((1,), torch.int32)}, INT2_8)
    assert error.kind == "wrong_dtype" and "dtype I64, expected I32" in error.error
    subset = decode_compressed(
        body,
        {**E20, "step": expect((1,), torch.int64), "x": expect((2,))},
        INT2_8,
        require_all=False,
    )
    assert set(subset) == {"w", "step"}


def test_a_non_finite_plain_float_is_refused() -> None:
    body = encode_compressed(
        {"w": torch.ones(4), "n": torch.tensor([float("nan")])}, INT2_8, exact={"n"}
    )
    error = refused(body, {"w": expect((4,)), "n": expect((1,))}, INT2_8, exact={"n"})
    assert error.kind == "non_finite" and error.detail["tensor"] == "n"


# ------------------------------------------------------------------ fuzzing

FUZZ_CODECS = [
    Codec("int8", block=8),
    Codec("int4", block=8),
    INT2_8,
    Codec("bf16"),
    Codec("int2", 0.25, block=8, chunk=8),
    Codec("fp32", 0.5, chunk=4),
]
FUZZ_TENSORS = {
    "w": torch.randn(37, generator=torch.Generator().manual_seed(1)),
    "s": torch.tensor([4]),
}
FUZZ_EXPECTED = {"w": expect((37,)), "s": expect((1,), torch.int64)}
FUZZ_BODIES = [bytes(encode_compressed(FUZZ_TENSORS, codec)) for codec in FUZZ_CODECS]


def _decodes_or_refuses(body: bytes, codec: Codec) -> None:
    try:
        decoded = decode_compressed(body, FUZZ_EXPECTED, codec)
    except WireError as error:
        assert error.status == 422
        return
    assert bool(torch.isfinite(decoded["w"]).all())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(FUZZ_CODECS) - 1),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_flipped_bytes_are_refused_or_decode_finite(which: int, flips: list) -> None:
    body = bytearray(FUZZ_BODIES[which])
    for position, mask in flips:
        body[position % len(body)] ^= mask
    _decodes_or_refuses(bytes(body), FUZZ_CODECS[which])


@settings(max_examples=200, deadline=None)
@given(which=st.integers(0, len(FUZZ_CODECS) - 1), cut=st.integers(0, 10_000))
def test_truncated_bodies_are_refused(which: int, cut: int) -> None:
    body = FUZZ_BODIES[which]
    with pytest.raises(WireError):
        decode_compressed(body[: cut % len(body)], FUZZ_EXPECTED, FUZZ_CODECS[which])


@settings(max_examples=200, deadline=None)
@given(which=st.integers(0, len(FUZZ_CODECS) - 1), data=st.binary(max_size=2000))
def test_random_bytes_are_refused(which: int, data: bytes) -> None:
    _decodes_or_refuses(data, FUZZ_CODECS[which])


@settings(max_examples=200, deadline=None)
@given(
    which=st.integers(0, len(FUZZ_CODECS) - 1),
    part=st.sampled_from(["codes", "scales", "indices"]),
    payload=st.binary(min_size=1, max_size=64),
    offset=st.integers(0, 100),
)
def test_random_part_contents_of_the_right_length_are_refused_or_finite(
    which: int, part: str, payload: bytes, offset: int
) -> None:
    """The header stays valid, so the value checks (not the parser) must catch everything."""
    codec = FUZZ_CODECS[which]
    parts = parts_of(bytearray(FUZZ_BODIES[which]))
    name = f"w#{part}"
    if name not in parts:
        return
    raw = parts[name].view(torch.uint8)
    for i, byte in enumerate(payload):
        if raw.numel():
            raw[(offset + i) % raw.numel()] = byte
    _decodes_or_refuses(bytes(body_of(parts, codec_metadata(codec))), codec)


def test_error_messages_name_the_tensor() -> None:
    body = _mutated(W20, INT2_8, lambda p: p["w#scales"].__setitem__(0, float("nan")))
    error = refused(body, E20, INT2_8)
    assert re.search(r"tensor 'w' part 'scales': block 0 has scale nan", error.error)
    assert error.to_body()["detail"] == {"tensor": "w", "part": "scales", "block": 0}
    assert struct.calcsize("<f") == 4


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "bf16", "topk:0.03+int2", "topk:0.5"])
def test_a_sender_s_fold_while_coding_moves_its_copy_as_a_receiver_s_fold_of_the_body(
    spec: str,
) -> None:
    """The server's published weights and a worker's residual move while the body is coded
    (`fold_into`); a receiver moves its copy by folding the finished body. Both must end
    bit for bit equal, and the residual must be what the receiver did not get."""
    codec = parse_codec(spec, block=64, chunk=64)
    generator = torch.Generator().manual_seed(11)
    sent = {
        # spans of three pieces, a tail block
        "w": torch.randn(3, piece_elements(torch.device("cpu")) * 2 // 3 + 5, generator=generator),
        "b": torch.randn(37, generator=generator),
    }
    start = {n: torch.randn(t.shape, generator=generator) for n, t in sent.items()}
    sender = {n: t.clone() for n, t in start.items()}
    body = encode_compressed(sent, codec, fold_into=sender)
    receiver = {n: t.clone() for n, t in start.items()}
    apply_delta(body, receiver, codec)
    moved = 0
    for name in sent:
        assert torch.equal(sender[name], receiver[name]), name
        moved += int((sender[name] != start[name]).sum())
    assert moved > 0
    # Error feedback: e folded with weight -1 while coding e is e - D(C(e)).
    residual = {n: t.clone() for n, t in sent.items()}
    body = encode_compressed(residual, codec, fold_into=residual, weight=-1.0)
    decoded = decode_compressed(
        body, {n: (tuple(t.shape), t.dtype) for n, t in sent.items()}, codec
    )
    for name, tensor in sent.items():
        assert torch.equal(residual[name], tensor - decoded[name]), name


def test_a_codec_mismatch_repeats_only_a_little_of_the_sender_s_metadata() -> None:
    codec = parse_codec("int8", block=64)
    metadata = {f"diloco.x{i:03d}": "v" * 5000 for i in range(300)}
    with pytest.raises(WireError) as refused:
        check_codec_metadata(metadata, codec)
    got = refused.value.detail["got"]
    assert len(got) == 8  # of 300 keys
    assert all(len(k) <= 64 and len(v) == 64 for k, v in got.items())
    assert len(json.dumps(refused.value.to_body())) < 4000


def test_a_staged_body_is_the_body_and_a_wrong_staging_buffer_is_refused():
    """`encode_compressed(staging=...)` codes into the given buffer and copies its data
    section: the same bytes as without it, whatever the buffer held; a buffer of the wrong
    size or dtype is a ValueError naming the size it needs."""
    generator = torch.Generator().manual_seed(2)
    tensors = {
        "w": torch.randn(1000, generator=generator),
        "b": torch.randn(7, generator=generator),
        "steps": torch.tensor(3, dtype=torch.int64),
    }
    for text in ("int8", "int2", "topk:0.1+int8", "bf16"):
        codec = parse_codec(text)
        plain = encode_compressed(tensors, codec, exact={"b"})
        junk = torch.full((len(plain),), 0x5A, dtype=torch.uint8)
        staged = encode_compressed(tensors, codec, exact={"b"}, staging=lambda n, j=junk: j[:n])
        assert staged == plain, text
    codec = parse_codec("int8")
    size = len(encode_compressed(tensors, codec))
    with pytest.raises(ValueError, match=f"1-D uint8 tensor of {size} bytes"):
        encode_compressed(tensors, codec, staging=lambda n: torch.zeros(n + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"1-D uint8 tensor of {size} bytes"):
        encode_compressed(tensors, codec, staging=lambda n: torch.zeros(n, dtype=torch.int8))
