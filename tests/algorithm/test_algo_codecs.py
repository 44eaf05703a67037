"""Codecs (algorithm/compression/codecs.py): every expected value below is worked out by
hand in the test, never obtained from the code under test."""

from __future__ import annotations

import math
import re

import pytest
import torch

from diloco.algorithm.compression.codecs import (
    Codec,
    Encoded,
    Layout,
    decode,
    decode_into,
    encode,
    encoded_nbytes,
    error_feedback_step,
    max_abs,
    parse_codec,
    piece_elements,
    read_elements,
    require_kept_values,
)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def levels(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    ("text", "values", "fraction", "canonical"),
    [
        ("fp32", "fp32", None, "fp32"),
        (" Float32 ", "fp32", None, "fp32"),
        ("BF16", "bf16", None, "bf16"),
        ("bfloat16", "bf16", None, "bf16"),
        ("int8", "int8", None, "int8"),
        ("  INT4\n", "int4", None, "int4"),
        ("int2", "int2", None, "int2"),
        ("topk:0.03+int2", "int2", 0.03, "topk:0.03+int2"),
        ("TopK:0.01 + INT2", "int2", 0.01, "topk:0.01+int2"),
        ("topk:0.5", "fp32", 0.5, "topk:0.5"),
        ("topk:0.5+fp32", "fp32", 0.5, "topk:0.5"),
        ("topk:1+bfloat16", "bf16", 1.0, "topk:1.0+bf16"),
        ("topk:1e-3+int8", "int8", 0.001, "topk:0.001+int8"),
    ],
)
def test_parse_accepts_specs_and_aliases(
    text: str, values: str, fraction: float | None, canonical: str
) -> None:
    codec = parse_codec(text)
    assert (codec.values, codec.fraction, codec.block, codec.chunk) == (
        values,
        fraction,
        128,
        128,
    )
    assert str(codec) == canonical
    assert parse_codec(str(codec)) == codec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "int3",
            "unknown codec 'int3'; allowed: fp32, bf16, int8, int4, int2, topk:F, topk:F+VALUES",
        ),
        ("", "unknown codec ''; allowed: fp32"),
        ("topk:1.5", "top-k fraction must be in (0, 1], got 1.5"),
        ("topk:0", "top-k fraction must be in (0, 1], got 0"),
        ("topk:-0.1+int2", "top-k fraction must be in (0, 1], got -0.1"),
        ("topk:nan", "top-k fraction must be in (0, 1], got nan"),
        ("topk:inf+int8", "top-k fraction must be in (0, 1], got inf"),
        ("topk:abc", "top-k fraction must be a number in (0, 1], got 'abc'"),
        ("topk:", "top-k fraction must be a number in (0, 1], got ''"),
        ("topk:0.1+int3", "unknown value codec 'int3' in 'topk:0.1+int3'; allowed after"),
        ("topk:0.1+topk:0.2", "unknown value codec 'topk:0.2'"),
    ],
)
def test_parse_refuses_bad_specs_naming_the_value_and_the_allowed_set(
    text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_codec(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block": 100}, "block size must be a positive power of two in [8, 65536], got 100"),
        ({"block": 4}, "block size must be a positive power of two in [8, 65536], got 4"),
        ({"block": 131072}, "block size must be a positive power of two in [8, 65536], got 131072"),
        ({"block": True}, "block size must be a positive power of two in [8, 65536], got True"),
        ({"chunk": 3}, "chunk size must be a positive power of two in [2, 65536], got 3"),
        ({"chunk": 1}, "chunk size must be a positive power of two in [2, 65536], got 1"),
        ({"chunk": 0}, "chunk size must be a positive power of two in [2, 65536], got 0"),
    ],
)
def test_block_and_chunk_must_be_powers_of_two_in_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_codec("int8", **kwargs)


def test_a_fraction_over_one_names_the_k_it_would_keep_and_the_chunk() -> None:
    message = "got 1.5: each chunk of 128 would keep k = round(1.5 x 128) = 192 values"
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_codec("topk:1.5", chunk=128)


@pytest.mark.parametrize(
    ("text", "chunk", "message"),
    [
        (
            "topk:0.0001",
            128,
            "top-k topk:0.0001 keeps k = round(0.0001 x 128) = 0 values of each chunk of 128 "
            "(k must be at least 1): give a fraction of at least 1/128 = 0.007812 or a chunk "
            "of at least 8192",
        ),
        ("topk:0.03+int2", 16, "round(0.03 x 16) = 0 values of each chunk of 16"),  # 0.48
        ("topk:0.5", 2, None),  # round(1.0) = 1
        ("topk:0.03+int2", 32, None),  # round(0.96) = 1
        ("topk:1e-7", 128, "at least 1/128 = 0.007812"),  # and no chunk would do
        ("int8", 128, None),
    ],
)
def test_a_fraction_that_keeps_no_value_of_a_chunk_is_refused_for_a_user_s_settings(
    text: str, chunk: int, message: str | None
) -> None:
    """parse_codec keeps the wire's k = max(1, ...) rule (a worker decodes what it is sent);
    require_kept_values, which the server's and the simulator's settings call, refuses the
    fraction that would silently send 1 value per chunk instead of round(F x chunk) = 0."""
    codec = parse_codec(text, chunk=chunk)
    if message is None:
        assert require_kept_values(codec) is codec
        return
    assert codec.k == 1  # what the wire rule would have sent
    with pytest.raises(ValueError) as refused:
        require_kept_values(codec)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert ("a chunk of at least" in str(refused.value)) == (text != "topk:1e-7")


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown value codec 'int3'")):
        Codec("int3")
    with pytest.raises(ValueError, match=re.escape("top-k fraction must be in (0, 1], got nan")):
        Codec("int2", math.nan)


def test_properties() -> None:
    assert Codec().is_identity and not Codec("bf16").is_identity
    assert not Codec("fp32", 0.5).is_identity
    assert [Codec(v).bits for v in ("fp32", "bf16", "int8", "int4", "int2")] == [32, 16, 8, 4, 2]
    assert [Codec(v).max_level for v in ("int8", "int4", "int2")] == [254, 14, 3]
    assert [Codec(v).level_offset for v in ("int8", "int4", "int2")] == [127, 7, 1.5]
    assert Codec("int2", 0.1, chunk=128).index_bits == 7
    assert Codec("int2", 0.1, chunk=4096).index_bits == 12
    assert Codec("int2").index_bits == 0 and Codec("int2").k == 0


@pytest.mark.parametrize(
    ("fraction", "chunk", "k"),
    [
        (0.03, 128, 4),  # 3.84 -> 4
        (0.01, 128, 1),  # 1.28 -> 1
        (0.001, 128, 1),  # 0.128 rounds to 0; at least 1
        (1.0, 128, 128),
        (0.625, 4, 2),  # 2.5: half to even
        (0.875, 4, 4),  # 3.5: half to even
        (0.02, 4096, 82),  # 81.92
    ],
)
def test_k_rounds_the_product_half_to_even_between_one_and_chunk(
    fraction: float, chunk: int, k: int
) -> None:
    assert Codec("int2", fraction, chunk=chunk).k == k


# ------------------------------------------------------------------ int8, int4, int2, bf16


def test_int8_hand_vector_with_ties_half_to_even_and_a_short_tail_block() -> None:
    codec = Codec("int8", block=8)
    # block 0: absmax 127, s = 1; block 1 (2 values, padded with zeros): absmax 254, s = 2
    x = t([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0, 2.0, -254.0])
    encoded = encode(x, codec)
    assert torch.equal(encoded.scales, t([1.0, 2.0]))
    # round: 0, 2, 2, -0, -2, -2, 4, 127 | 1, -127; stored as code + 127
    assert torch.equal(encoded.codes, levels([127, 129, 129, 127, 125, 125, 131, 254, 128, 0]))
    assert encoded.indices is None and encoded.numel == 10
    assert torch.equal(decode(encoded, codec), t([0, 2, 2, 0, -2, -2, 4, 127, 2, -254]))
    assert max_abs(encoded, codec) == 254.0


def test_int8_rounds_to_the_nearest_multiple_of_the_scale() -> None:
    codec = Codec("int8", block=8)
    # absmax 63.5 -> s = 0.5: 0.3 -> 0.6 -> 1; 0.7 -> 1.4 -> 1; -0.8 -> -1.6 -> -2
    x = t([0.3, 0.7, -0.8, 63.5, 0, 0, 0, -63.5])
    encoded = encode(x, codec)
    assert torch.equal(encoded.scales, t([0.5]))
    assert torch.equal(encoded.codes, levels([128, 128, 125, 254, 127, 127, 127, 0]))
    assert torch.equal(decode(encoded, codec), t([0.5, 0.5, -1.0, 63.5, 0, 0, 0, -63.5]))


def test_an_all_zero_block_has_scale_zero_and_zero_level_codes() -> None:
    for values, zero_level in (("int8", 127), ("int4", 7), ("int2", 2)):
        codec = Codec(values, block=8)
        encoded = encode(torch.cat([torch.zeros(8), t([1.0])]), codec)
        assert encoded.scales[0] == 0
        assert encoded.codes[:8].tolist() == [zero_level] * 8
        assert torch.equal(decode(encoded, codec)[:8], torch.zeros(8))
        # of either sign: the scale is +0.0 (sign bit clear), the same bytes on every device
        negative = encode(torch.cat([-torch.zeros(8), torch.zeros(8)]), codec)
        assert negative.scales.view(torch.int32).tolist() == [0, 0]


def test_a_block_whose_scale_underflows_is_coded_as_zeros() -> None:
    codec = Codec("int8", block=8)
    tiny = torch.full((8,), 1.401298464324817e-45)  # the smallest subnormal: / 127 is 0
    encoded = encode(tiny, codec)
    assert encoded.scales.tolist() == [0.0] and encoded.codes.tolist() == [127] * 8
    assert decode(encoded, codec).tolist() == [0.0] * 8


def test_int4_hand_vector() -> None:
    codec = Codec("int4", block=8)
    # block 0: absmax 7, s = 1: 3.5 -> 4, 2.5 -> 2, -0.4 -> -0, 0.6 -> 1, -6.5 -> -6 (half even)
    # block 1: absmax 3.5, s = 0.5: 7, -2, 0.5 -> 0
    x = t([7, -7, 3.5, 2.5, -0.4, 0.6, 1, -6.5, 3.5, -1.0, 0.25])
    encoded = encode(x, codec)
    assert torch.equal(encoded.scales, t([1.0, 0.5]))
    assert torch.equal(encoded.codes, levels([14, 0, 11, 9, 7, 8, 8, 1, 14, 5, 7]))
    assert torch.equal(decode(encoded, codec), t([7, -7, 4, 2, 0, 1, 1, -6, 3.5, -1, 0]))
    assert max_abs(encoded, codec) == 7.0


def test_int2_is_mid_rise_with_four_levels() -> None:
    codec = Codec("int2", block=8)
    # block 0: absmax 3, s = 2; c = floor(x / 2 + 2): 3.5, 0.5, 2, 2.5, 1.5, 2.45, 1, 3
    # -> 3, 0, 2, 2, 1, 2, 1, 3 (a value on a boundary, -2 and 2, goes up)
    # block 1: 0.75 alone: s = 0.5, 0.75 / 0.5 + 2 = 3.5 -> 3
    x = t([3, -3, 0, 1, -1, 0.9, -2.0, 2.0, 0.75])
    encoded = encode(x, codec)
    assert torch.equal(encoded.scales, t([2.0, 0.5]))
    assert torch.equal(encoded.codes, levels([3, 0, 2, 2, 1, 2, 1, 3, 3]))
    # (c - 1.5) * s
    assert torch.equal(decode(encoded, codec), t([3, -3, 1, 1, -1, 1, -1, 3, 0.75]))
    assert max_abs(encoded, codec) == 3.0


def test_bf16_is_a_cast_rounding_to_nearest_even() -> None:
    codec = Codec("bf16")
    # bf16 keeps 8 significant bits: 1 + 2^-8 is halfway to 1 + 2^-7 and goes to the even 1;
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 and goes to the even 1 + 2^-6
    x = t([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -2.0])
    encoded = encode(x, codec)
    assert encoded.codes.dtype == torch.bfloat16 and encoded.scales is None
    assert decode(encoded, codec).tolist() == [1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.0]


def test_fp32_is_the_identity_in_new_memory() -> None:
    x = t([1.5, -2.25, 2.0**-100])
    encoded = encode(x, Codec())
    assert torch.equal(decode(encoded, Codec()), x)
    encoded.codes.zero_()
    assert x.tolist() == [1.5, -2.25, 2.0**-100]


def test_a_bf16_input_is_coded_as_its_fp32_values() -> None:
    codec = Codec("int8", block=8)
    x = t([127.0, 1.0, -2.0, 3.0, 0, 0, 0, 0]).bfloat16()
    encoded = encode(x, codec)
    assert torch.equal(decode(encoded, codec), t([127.0, 1.0, -2.0, 3.0, 0, 0, 0, 0]))


# ------------------------------------------------------------------ top-k


def test_topk_keeps_the_largest_magnitudes_per_chunk_in_index_order() -> None:
    codec = Codec("fp32", 0.5, chunk=4)  # k = 2
    # chunk 0: |-5| and 3 (indices 1, 2); chunk 1 all zeros: a tie, the lower indices 0, 1;
    # chunk 2, the tail (3 elements): 7 and 4 (indices 0, 2)
    x = t([1, -5, 3, 2, 0, 0, 0, 0, 7, -1, 4])
    encoded = encode(x, codec)
    assert encoded.indices.tolist() == [1, 2, 0, 1, 0, 2]
    assert encoded.codes.tolist() == [-5, 3, 0, 0, 7, 4]
    assert decode(encoded, codec).tolist() == [0, -5, 3, 0, 0, 0, 0, 0, 7, 0, 4]


def test_a_tail_chunk_shorter_than_k_keeps_all_its_elements() -> None:
    codec = Codec("fp32", 0.75, chunk=4)  # k = 3
    encoded = encode(t([1, 2, 3, -4, 9]), codec)
    assert encoded.indices.tolist() == [1, 2, 3, 0]
    assert encoded.codes.tolist() == [2, 3, -4, 9]
    assert Layout(5, codec).values == 4


def test_ties_go_to_the_lower_index_in_a_short_tail_and_for_a_large_k() -> None:
    """Every device keeps the same elements only if ties have one rule everywhere."""
    codec = Codec("fp32", 0.5, chunk=8)  # k = 4
    # chunk 0: 2 and -2 (indices 1, 6), then the zeros at 0 and 2; tail (6 zeros and -1): -1
    # (index 6), then the lowest zeros 0, 1, 2
    x = t([0, 2, 0, 0, 0, 0, -2, 0, *[0] * 6, -1])
    encoded = encode(x, codec)
    assert encoded.indices.tolist() == [0, 1, 2, 6, 0, 1, 2, 6]
    assert encoded.codes.tolist() == [0, 2, 0, -2, 0, 0, 0, -1]
    large = Codec("fp32", 0.75, chunk=32)  # k = 24, past the iterative search (16)
    row = torch.zeros(32)
    row[[3, 30]] = t([5, -5])  # two kept by size, then the 22 lowest zeros: 0-2, 4-22
    assert encode(row, large).indices.tolist() == [0, 1, 2, 3, *range(4, 23), 30]


def test_topk_with_int2_values() -> None:
    codec = Codec("int2", 0.5, block=8, chunk=4)  # k = 2
    # kept: chunk 0 -> -6 (1), 3 (2); chunk 1 -> -1.5 (2), 6 (3); values [-6, 3, -1.5, 6]
    # one block: absmax 6, s = 4; c = floor(x / 4 + 2): 0.5, 2.75, 1.625, 3.5 -> 0, 2, 1, 3
    x = t([1, -6, 3, 2, 0.5, 0, -1.5, 6])
    encoded = encode(x, codec)
    assert encoded.indices.tolist() == [1, 2, 2, 3]
    assert encoded.codes.tolist() == [0, 2, 1, 3]
    assert encoded.scales.tolist() == [4.0]
    # (c - 1.5) * 4 = -6, 2, -2, 6 at their places
    assert decode(encoded, codec).tolist() == [0, -6, 2, 0, 0, 0, -2, 6]


def test_topk_picks_the_same_elements_as_a_sort_on_many_chunks() -> None:
    generator = torch.Generator().manual_seed(3)
    for k_fraction, chunk in ((0.03, 128), (0.01, 128), (0.25, 64), (0.5, 128)):
        codec = Codec("fp32", k_fraction, chunk=chunk)
        x = torch.randn(chunk * 300 + 17, generator=generator)
        encoded = encode(x, codec)
        k = codec.k
        for row in (0, 1, 150, 299):  # a few chunks, checked against a plain sort
            part = x[row * chunk : (row + 1) * chunk]
            expected = sorted(sorted(range(chunk), key=lambda i: -abs(float(part[i])))[:k])
            assert encoded.indices[row * k : (row + 1) * k].tolist() == expected


def test_decode_into_adds_weighted_values_and_touches_only_kept_positions() -> None:
    codec = Codec("fp32", 0.5, chunk=4)
    target = t([10, 10, 10, 10, 10])
    decode_into(encode(t([1, -5, 3, 2, 8]), codec), codec, target, weight=0.5)
    assert target.tolist() == [10, 7.5, 11.5, 10, 14]
    dense = Codec("int8", block=8)
    target = t([1, 1, 1])
    decode_into(encode(t([127, -127, 2]), dense), dense, target, weight=-1.0)
    assert target.tolist() == [-126, 128, -1]


def test_encode_folds_what_it_sends_by_hand_signs_of_zero_included() -> None:
    codec = Codec("int8", block=8)
    # absmax 127, s = 1: -0.4 rounds to -0, whose code 127 decodes to +0 (127 - 127); a
    # target of -0 plus that +0 is +0, as a receiver's decode_into makes it
    x = t([127, -0.4, 2.6, -3.5, 0, 0, 0, 0, 1.0])  # tail block: absmax 1, s = 1/127
    target = t([-0.0, -0.0, 1, 1, -0.0, 0, 0, 0, 10])
    encoded = encode(x, codec, fold_into=target, weight=1.0)
    assert encoded.codes.tolist() == [254, 127, 130, 123, 127, 127, 127, 127, 254]
    # decoded: 127, +0, 3, -4, +0 x 4 | 127 * (1/127 as fp32)
    tail = 127 * torch.tensor(1 / 127, dtype=torch.float32)
    assert target[:8].tolist() == [127, 0, 4, -3, 0, 0, 0, 0]
    assert target[:8].view(torch.int32).tolist()[1] == 0  # +0, not -0
    assert target[4].view(torch.int32) == 0
    assert target[8] == 10 + tail
    # weight -1 into the values themselves (error feedback): x keeps what was lost
    residual = x.clone()
    encode(residual, codec, fold_into=residual, weight=-1.0)
    assert residual[:8].tolist() == pytest.approx([0, -0.4, -0.4, 0.5, 0, 0, 0, 0], abs=1e-6)
    assert residual[8] == 1.0 - tail


@pytest.mark.parametrize(
    ("values", "exact"),
    [  # blocks of whole levels (s = 1; int2's s = 2, levels -3, -1, 1, 3): decoded exactly
        ("int8", [127, -127, 2, 0, 5, -5, 64, 1]),
        ("int4", [7, -7, 1, 0, 2, -2, 3, 4]),
        ("int2", [3, -3, 1, -1, 3, -3, 1, -1]),
    ],
)
def test_a_block_of_nan_or_inf_has_that_scale_and_folds_to_no_finite_value(
    values: str, exact: list
) -> None:
    codec = Codec(values, block=8)
    x = torch.cat([t(exact), t([math.nan] + [1.0] * 7), t([math.inf] + [1.0] * 7)])
    target = torch.zeros(24)
    encoded = encode(x, codec, fold_into=target)
    assert math.isnan(encoded.scales[1]) and encoded.scales[2] == math.inf
    assert target[:8].tolist() == exact  # the finite block, untouched by its neighbours
    assert not torch.isfinite(target[8:]).any()  # never a plausible number in their place


@pytest.mark.parametrize(
    ("values", "x", "decoded"),
    [
        # int4 block 0 of the int4 hand vector: 3.5 -> 4, -0.4 -> 0, -6.5 -> -6
        ("int4", [7, -7, 3.5, 2.5, -0.4, 0.6, 1, -6.5], [7, -7, 4, 2, 0, 1, 1, -6]),
        # int2: s = 2, levels (c - 1.5) * 2 = -3, -1, 1, 3 (the int2 hand vector's block 0)
        ("int2", [3, -3, 0, 1, -1, 0.9, -2.0, 2.0], [3, -3, 1, 1, -1, 1, -1, 3]),
    ],
)
def test_encode_folds_other_widths_by_hand(values: str, x: list, decoded: list) -> None:
    codec = Codec(values, block=8)
    target = torch.full((8,), 100.0)
    encode(t(x), codec, fold_into=target, weight=0.5)
    assert target.tolist() == [100 + 0.5 * d for d in decoded]


def test_encode_folds_over_many_pieces_and_a_tail() -> None:
    # two pieces and 12 values, every block of 8 [127, -127, 2, 0, 5, -5, 64, 1]: s = 1 and
    # every value is a whole level, so each decodes exactly to itself; the tail's 4 values too
    pattern = t([127, -127, 2, 0, 5, -5, 64, 1])
    numel = 2 * piece_elements(torch.device("cpu")) + 12
    x = pattern.repeat(numel // 8 + 1)[:numel]
    x[-4:] = t([127, 3, -3, 0])
    target = torch.ones_like(x)
    encoded = encode(x, Codec("int8", block=8), fold_into=target, weight=-2.0)
    assert torch.equal(target, 1 - 2 * x)
    assert encoded.scales.eq(1).all() and encoded.codes[:8].tolist() == [
        254,
        0,
        129,
        127,
        132,
        122,
        191,
        128,
    ]


def test_a_receiver_reads_top_k_in_large_spans_and_dense_codecs_in_pieces() -> None:
    """A top-k span holds k / chunk of its values: a receiver reads spans of as many kept
    values as a piece (2^19 on CPU) holds values, at most 2^23 elements (on an accelerator
    its larger pieces); a dense one reads pieces. By hand, chunks of 128: topk:0.03 keeps
    k = 4, 2^19 x 32 = 2^24, capped at 2^23; topk:0.5 keeps 64, 2^19 x 2 = 2^20; topk:1.0
    keeps all, 2^19."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    topk = parse_codec("topk:0.03+int2")
    assert piece_elements(cpu) == 1 << 19 and topk.k == 4
    assert read_elements(topk, cpu) == 1 << 23
    assert read_elements(parse_codec("topk:0.5+int8"), cpu) == 1 << 20
    assert read_elements(parse_codec("topk:1.0"), cpu) == 1 << 19
    assert read_elements(topk, gpu) == max(1 << 23, piece_elements(gpu))
    for spec in ("int8", "int2", "bf16"):
        assert read_elements(parse_codec(spec), cpu) == piece_elements(cpu)
    spans = list(Layout(3 << 20, topk).spans(read_elements(topk, cpu)))
    assert len(spans) == 1 and (spans[0].start, spans[0].stop) == (0, 3 << 20)


def test_encode_writes_into_given_parts_and_checks_them() -> None:
    codec = Codec("int8", block=8)
    x = t([127, -127, 2, 0, 5, -5, 64, 1, 254])
    codes, scales = torch.zeros(9, dtype=torch.uint8), torch.zeros(2)
    encoded = encode(x, codec, out=Encoded(9, codes, scales))
    assert encoded.codes is codes and encoded.scales is scales
    assert codes.tolist() == [254, 0, 129, 127, 132, 122, 191, 128, 254]
    assert scales.tolist() == [1.0, 2.0]

    def refused(message: str, **parts: torch.Tensor | int | None) -> None:
        given = {"numel": 9, "codes": codes, "scales": scales, **parts}
        with pytest.raises(ValueError, match=re.escape(message)):
            encode(given.pop("x", x), codec, out=Encoded(**given))

    contiguous = "must be a contiguous torch"
    refused(f"out.codes {contiguous}.uint8 tensor of 9 elements for int8, got torch.uint8 of 8",
            codes=torch.zeros(8, dtype=torch.uint8))  # fmt: skip
    refused(f"out.scales {contiguous}.float32 tensor of 2 elements for int8, got torch.float64",
            scales=torch.zeros(2, dtype=torch.float64))  # fmt: skip
    refused("got torch.float32 of 2 elements (not contiguous)", scales=torch.zeros(4)[::2])
    refused("out.indices must be None for int8", indices=torch.zeros(9, dtype=torch.int64))
    refused("out.codes must be on meta, the values' device, got cpu", x=x.to("meta"))
    refused("out must encode 9 elements, got 8", numel=8)
    with pytest.raises(ValueError, match="fold_into must be a contiguous fp32 tensor of 9"):
        encode(x, codec, fold_into=torch.zeros(8))
    with pytest.raises(ValueError, match="fold_into must be on cpu, got meta"):
        encode(x, codec, fold_into=torch.zeros(9, device="meta"))
    assert codes.tolist() == [254, 0, 129, 127, 132, 122, 191, 128, 254]  # untouched


def test_decode_into_checks_its_target() -> None:
    codec = Codec("int8", block=8)
    encoded = encode(t([1, 2, 3]), codec)
    with pytest.raises(ValueError, match="target must be a contiguous fp32 tensor of 3 elements"):
        decode_into(encoded, codec, torch.zeros(4))
    with pytest.raises(ValueError, match="out must be a contiguous fp32 tensor of 3 elements"):
        decode(encoded, codec, out=torch.zeros(3, dtype=torch.float64))


# ------------------------------------------------------------------ sizes and layout


@pytest.mark.parametrize(
    ("numel", "spec", "block", "chunk", "nbytes"),
    [
        (1000, "int8", 128, 128, 1000 + 8 * 4),  # 8 blocks (the last short)
        (10, "int2", 8, 128, 3 + 2 * 4),  # 20 bits -> 3 bytes; 2 blocks
        (10, "int4", 8, 128, 5 + 2 * 4),
        (5, "fp32", 128, 128, 20),
        (5, "bf16", 128, 128, 10),
        (0, "int8", 128, 128, 0),
        # 7 full chunks of 4 values, the tail (104) keeps 4: 32 values; 64 bits of codes,
        # one block, 32 indices at 7 bits = 224 bits = 28 bytes
        (1000, "topk:0.03+int2", 128, 128, 8 + 4 + 28),
        # k = 2 of chunks of 4, the tail of 2 keeps 2: 6 fp32 values, 6 indices at 2 bits
        (10, "topk:0.5", 128, 4, 24 + 2),
    ],
)
def test_encoded_nbytes_by_hand(numel: int, spec: str, block: int, chunk: int, nbytes: int) -> None:
    assert encoded_nbytes(numel, parse_codec(spec, block=block, chunk=chunk)) == nbytes


def test_group_sizes_align_every_part_to_whole_bytes_and_blocks() -> None:
    assert Layout(10**6, Codec("int8", block=64)).group_elements == 64
    # k = 4, block 128: 32 chunks hold 128 values, one block
    assert Layout(10**6, parse_codec("topk:0.03+int2")).group_elements == 32 * 128
    assert Layout(10**6, parse_codec("topk:0.01+int2")).group_elements == 128 * 128
    # fp32 values: 8 values (so that 8 indices fill whole bytes): 4 chunks of k = 2
    assert Layout(10**6, Codec("fp32", 0.5, chunk=4)).group_elements == 16


def test_a_span_names_the_slices_of_every_part() -> None:
    layout = Layout(20, Codec("int2", block=8))
    assert layout.groups == 3
    span = layout.span(1, 3)
    assert (span.start, span.stop, span.values, span.blocks) == (8, 20, (8, 20), (1, 3))
    assert (span.code_bytes, span.scale_bytes, span.index_bytes) == ((2, 5), (4, 12), (0, 0))
    sparse = Layout(37, Codec("int2", 0.5, block=8, chunk=4))  # k = 2, groups of 4 chunks
    span = sparse.span(2, 3)  # chunks 8 and 9 (the tail of 1)
    assert (span.start, span.stop, span.values, span.blocks) == (32, 37, (16, 19), (2, 3))
    assert (span.code_bytes, span.index_bytes) == ((4, 5), (4, 5))


def test_a_range_decodes_like_the_slice_of_a_full_decode() -> None:
    generator = torch.Generator().manual_seed(11)
    specs = ("int8", "int4", "int2", "bf16", "fp32", "topk:0.03+int2", "topk:0.3", "topk:0.2+int8")
    for trial in range(40):
        spec = specs[trial % len(specs)]
        block = 2 ** int(torch.randint(3, 8, (1,), generator=generator))
        chunk = 2 ** int(torch.randint(1, 9, (1,), generator=generator))
        codec = parse_codec(spec, block=block, chunk=chunk)
        numel = int(torch.randint(0, 5000, (1,), generator=generator))
        x = torch.randn(numel, generator=generator)
        layout = Layout(numel, codec)
        encoded = encode(x, codec)
        full = decode(encoded, codec)
        first = int(torch.randint(0, layout.groups + 1, (1,), generator=generator))
        end = int(torch.randint(first, layout.groups + 1, (1,), generator=generator))
        span = layout.span(first, end)
        part = encoded.select(span)
        assert torch.equal(decode(part, codec), full[span.start : span.stop]), (spec, numel)
        # and coding the span's elements alone gives exactly that slice of the encoding
        alone = encode(x[span.start : span.stop], codec)
        assert torch.equal(alone.codes, part.codes)
        assert (alone.scales is None) or torch.equal(alone.scales, part.scales)
        assert (alone.indices is None) or torch.equal(alone.indices, part.indices)


def test_select_of_an_encoded_tensor_covers_it_exactly() -> None:
    codec = Codec("int8", block=8)
    encoded = encode(torch.arange(20, dtype=torch.float32), codec)
    pieces = [encoded.select(span) for span in Layout(20, codec).spans(8)]
    assert [p.numel for p in pieces] == [8, 8, 4]
    assert torch.equal(torch.cat([p.codes for p in pieces]), encoded.codes)
    assert isinstance(pieces[0], Encoded)


# ------------------------------------------------------------------ error feedback


def test_error_feedback_over_three_steps_by_hand() -> None:
    codec = Codec("fp32", 0.25, chunk=4)  # k = 1: only the largest magnitude is sent
    residual = torch.zeros(4)
    inputs = [t([1, 2, 0, 0]), t([0, 0, 0.5, 0]), t([0, 1, 0, 0])]
    sent = []
    # step 1: e = [1, 2, 0, 0]; send 2 at 1; e = [1, 0, 0, 0]
    # step 2: e = 0.9 e + g = [0.9, 0, 0.5, 0]; send 0.9 at 0; e = [0, 0, 0.5, 0]
    # step 3: e = [0, 1, 0.45, 0]; send 1 at 1; e = [0, 0, 0.45, 0]
    expected_sent = [[0, 2, 0, 0], [0.9, 0, 0, 0], [0, 1, 0, 0]]
    expected_residual = [[1, 0, 0, 0], [0, 0, 0.5, 0], [0, 0, 0.45, 0]]
    for g, want_sent, want_residual in zip(inputs, expected_sent, expected_residual, strict=True):
        encoded, same = error_feedback_step(residual, g, 0.9, codec)
        assert same is residual
        sent.append(decode(encoded, codec))
        assert sent[-1].tolist() == pytest.approx(want_sent, abs=1e-7)
        assert residual.tolist() == pytest.approx(want_residual, abs=1e-7)
    # e_T = sum_t beta^(T-t) (g_t - s_t), so the beta-decayed sum of what was sent plus the
    # final residual is the beta-decayed sum of the inputs:
    # 0.81 [0, 2, 0, 0] + 0.9 [0.9, 0, 0, 0] + [0, 1, 0, 0] + [0, 0, 0.45, 0]
    #   = 0.81 [1, 2, 0, 0] + 0.9 [0, 0, 0.5, 0] + [0, 1, 0, 0] = [0.81, 2.62, 0.45, 0]
    decayed_sent = 0.81 * sent[0] + 0.9 * sent[1] + sent[2]
    assert (decayed_sent + residual).tolist() == pytest.approx([0.81, 2.62, 0.45, 0], abs=1e-6)


def test_error_feedback_keeps_what_int2_loses() -> None:
    codec = Codec("int2", block=8)
    residual = torch.zeros(8)
    # e = g = [3, -3, 0, 1, -1, 0.9, -2, 2]; int2 sends [3, -3, 1, 1, -1, 1, -1, 3] (see the
    # int2 hand vector); e keeps the difference
    encoded, _ = error_feedback_step(residual, t([3, -3, 0, 1, -1, 0.9, -2, 2]), 0.5, codec)
    assert decode(encoded, codec).tolist() == [3, -3, 1, 1, -1, 1, -1, 3]
    assert residual.tolist() == pytest.approx([0, 0, -1, 0, 0, -0.1, -1, -1], abs=1e-6)
    # next step, g = 0: e = 0.5 e = [0, 0, -0.5, 0, 0, -0.05, -0.5, -0.5]: absmax 0.5,
    # s = 1/3; x / s + 2 = 2, 2, 0.5, 2, 2, 1.85, 0.5, 0.5 -> c = 2, 2, 0, 2, 2, 1, 0, 0
    encoded, _ = error_feedback_step(residual, torch.zeros(8), 0.5, codec)
    assert encoded.codes.tolist() == [2, 2, 0, 2, 2, 1, 0, 0]


@pytest.mark.parametrize("beta", [1.0, -0.1, math.nan, True])
def test_error_feedback_beta_must_be_in_zero_one(beta: float) -> None:
    with pytest.raises(ValueError, match=re.escape("error-feedback beta must be in [0, 1), got")):
        error_feedback_step(torch.zeros(2), torch.zeros(2), beta, Codec("int8"))


def test_error_feedback_with_the_identity_sends_everything() -> None:
    residual = t([1.0, 2.0])
    encoded, _ = error_feedback_step(residual, t([0.5, 0.25]), 0.5, Codec())
    assert decode(encoded, Codec()).tolist() == [1.0, 1.25] and residual.tolist() == [0, 0]


def test_a_top_k_group_past_a_mebi_value_is_refused_with_a_way_out() -> None:
    # k = round(0.03 * 65536) = 1966, gcd(1966, 128) = 2: 64 chunks of 65536 per group.
    with pytest.raises(ValueError, match="groups of 4194304 values; at most 1048576"):
        parse_codec("topk:0.03+int2", block=128, chunk=65536)
    # k = round(0.03 * 4096) = 123, odd: 128 chunks of 4096 = 524,288 values, allowed.
    assert parse_codec("topk:0.03+int2", block=128, chunk=4096).chunk == 4096
