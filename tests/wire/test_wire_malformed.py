"""decode_tensors refuses every malformed safetensors body with a 422 naming the problem."""

import contextlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.wire import WireError, decode_tensors, encode_tensors


def _file(header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    """A hand-made safetensors body: 8-byte length, header, data."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _malformed(buffer: bytes) -> WireError:
    with pytest.raises(WireError) as caught:
        decode_tensors(buffer)
    error = caught.value
    assert error.status == 422
    assert error.kind == "malformed_safetensors"
    assert error.error
    assert error.to_body() == {"error": error.error, "kind": error.kind, "detail": error.detail}
    return error


def test_a_hand_made_file_decodes() -> None:
    data = struct.pack("<2f", 1.5, -2.0) + struct.pack("<q", 7) + b"\x01"
    header = {
        "w": _entry("F32", [2], 0, 8),
        "n": _entry("I64", [], 8, 16),
        "m": _entry("BOOL", [1, 1], 16, 17),
        "e": _entry("F32", [0, 5], 17, 17),
        "__metadata__": {"format": "pt"},
    }
    decoded = decode_tensors(_file(header, data))
    assert decoded["w"].tolist() == [1.5, -2.0]
    assert decoded["n"].item() == 7 and decoded["n"].dim() == 0
    assert decoded["m"].tolist() == [[True]]
    assert decoded["e"].shape == (0, 5)
    assert "__metadata__" not in decoded


def test_misaligned_regions_are_copied_into_aligned_memory() -> None:
    data = b"\x01" + struct.pack("<q", 123456789)
    header = {"flag": _entry("U8", [1], 0, 1), "n": _entry("I64", [1], 1, 9)}
    decoded = decode_tensors(_file(header, data))
    assert decoded["n"].item() == 123456789
    assert decoded["n"].data_ptr() % 8 == 0


@pytest.mark.parametrize("size", [0, 1, 7])
def test_shorter_than_the_length_prefix(size: int) -> None:
    assert "8-byte" in _malformed(b"\x00" * size).error


def test_header_length_zero() -> None:
    assert "header length is 0" in _malformed(struct.pack("<Q", 0) + b"{}").error


def test_header_length_beyond_the_body() -> None:
    body = struct.pack("<Q", 50) + b"{}"
    assert "more than the 2 bytes" in _malformed(body).error


def test_header_length_over_the_limit() -> None:
    body = struct.pack("<Q", 100 * 1024 * 1024 + 1) + b"{}"
    assert "over the limit" in _malformed(body).error
    assert "over the limit" in _malformed(struct.pack("<Q", 2**64 - 1) + b"{}").error


def test_truncated_body() -> None:
    full = encode_tensors({"w": torch.randn(10)})
    error = _malformed(full[:-4])
    assert "'w'" in error.error and "outside" in error.error


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\xff\xfe", "start with '{'"),
        (b"{\xff}", "UTF-8"),
        (b"{not json}", "not valid JSON"),
        (b'{"a": 1', "not valid JSON"),
        (b'{"w": NaN}', "NaN"),
        (b"[" * 100_000, "start with '{'"),
        (b"{" + b'"a":{' * 100_000, "not valid JSON"),
    ],
)
def test_header_that_is_not_a_json_object(raw: bytes, words: str) -> None:
    assert words in _malformed(_file(None, raw_header=raw)).error


def test_header_json_list() -> None:
    assert "start with '{'" in _malformed(_file([1, 2])).error


def test_duplicate_names() -> None:
    raw = b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "w": {}}'
    assert "'w' twice" in _malformed(_file(None, b"\x00", raw_header=raw)).error


@pytest.mark.parametrize("metadata", [["x"], {"a": 1}, {"a": None}, "text"])
def test_metadata_not_strings_to_strings(metadata: object) -> None:
    assert "__metadata__" in _malformed(_file({"__metadata__": metadata})).error


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ([1, 2], "exactly the fields"),
        ({"dtype": "F32", "shape": [1]}, "exactly the fields"),
        ({**_entry("F32", [1], 0, 4), "extra": 1}, "exactly the fields"),
        (_entry("F8_E4M3", [4], 0, 4), "dtype 'F8_E4M3'"),
        (_entry("C64", [1], 0, 8), "dtype 'C64'"),
        ({**_entry("F32", [1], 0, 4), "dtype": 3}, "dtype 3"),
        (_entry("U8", [-4], 0, 4), "shape [-4]"),
        (_entry("U8", [2.0, 2], 0, 4), "shape [2.0, 2]"),
        (_entry("U8", [True, 4], 0, 4), "shape [true, 4]"),
        (_entry("U8", "4", 0, 4), 'shape "4"'),
        ({**_entry("U8", [4], 0, 4), "data_offsets": [0]}, "data_offsets [0]"),
        ({**_entry("U8", [4], 0, 4), "data_offsets": [0, 4, 4]}, "data_offsets"),
        ({**_entry("U8", [4], 0, 4), "data_offsets": [-1, 3]}, "data_offsets [-1, 3]"),
        ({**_entry("U8", [4], 0, 4), "data_offsets": [0, "4"]}, "data_offsets"),
        (_entry("U8", [4], 2, 1), "outside"),
        (_entry("U8", [4], 0, 5), "outside"),
        (_entry("F32", [2], 0, 4), "needs 8"),
        (_entry("F32", [1], 0, 4) | {"shape": [2**40, 2**40]}, "needs"),
    ],
)
def test_bad_tensor_entry_names_the_tensor(entry: object, words: str) -> None:
    error = _malformed(_file({"weird.tensor": entry}, b"\x00" * 4))
    assert "'weird.tensor'" in error.error
    assert words in error.error
    assert error.detail["tensor"] == "weird.tensor"


def test_overlapping_regions() -> None:
    header = {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 2, 6)}
    error = _malformed(_file(header, b"\x00" * 6))
    assert "'b'" in error.error and "overlaps tensor 'a'" in error.error


def test_two_tensors_on_the_same_bytes() -> None:
    header = {"a": _entry("U8", [4], 0, 4), "b": _entry("I32", [1], 0, 4)}
    assert "overlaps" in _malformed(_file(header, b"\x00" * 4)).error


def test_empty_tensor_inside_another_region() -> None:
    header = {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [0], 2, 2)}
    assert "'b'" in _malformed(_file(header, b"\x00" * 4)).error


def test_gap_between_regions() -> None:
    header = {"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 4, 6)}
    error = _malformed(_file(header, b"\x00" * 6))
    assert "gap at bytes 2-4" in error.error and "'b'" in error.error


def test_gap_before_the_first_region() -> None:
    header = {"a": _entry("U8", [2], 2, 4)}
    assert "gap at bytes 0-2" in _malformed(_file(header, b"\x00" * 4)).error


def test_trailing_bytes_after_the_last_region() -> None:
    header = {"a": _entry("U8", [2], 0, 2)}
    assert "3 bytes after the last tensor" in _malformed(_file(header, b"\x00" * 5)).error
    assert "1 bytes after" in _malformed(_file({}, b"\x00")).error


def test_bool_bytes_other_than_zero_and_one() -> None:
    header = {"mask": _entry("BOOL", [3], 0, 3)}
    error = _malformed(_file(header, b"\x00\x01\x02"))
    assert "'mask'" in error.error and "0 and 1" in error.error


_VALID = encode_tensors(
    {
        "w": torch.randn(3, 4),
        "b": torch.randn(4, dtype=torch.bfloat16),
        "n": torch.tensor(5),
        "m": torch.tensor([True, False]),
        "e": torch.zeros(0, 2),
    }
)


@st.composite
def _mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(_VALID)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[position] = draw(st.integers(0, 255))
        elif action == "truncate":
            del data[position:]
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[position : position + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_mutated_bodies_decode_consistently_or_raise_wire_error(body: bytes) -> None:
    try:
        decoded = decode_tensors(body)
    except WireError as error:
        assert error.status == 422 and error.kind == "malformed_safetensors" and error.error
        return
    header_len = struct.unpack("<Q", body[:8])[0]
    header = json.loads(body[8 : 8 + header_len])
    data_len = len(body) - 8 - header_len
    assert set(decoded) == set(header) - {"__metadata__"}
    assert sum(t.numel() * t.element_size() for t in decoded.values()) == data_len
    for name, tensor in decoded.items():
        assert list(tensor.shape) == header[name]["shape"]
        begin, end = header[name]["data_offsets"]
        assert (
            bytes(tensor.reshape(-1).view(torch.uint8).numpy())
            == body[8 + header_len + begin : 8 + header_len + end]
        )


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_wire_error(body: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_tensors(body)
