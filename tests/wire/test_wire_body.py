"""read_body and parse_content_length: limits first, exact fill, clear errors."""

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest

from diloco.wire import WireError, parse_content_length, read_body


async def _chunks(parts: Iterable[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _must_not_be_read() -> AsyncIterator[bytes]:
    pytest.fail("the body was read although the request should be refused first")
    yield b""  # pragma: no cover


def _read(chunks: AsyncIterator[bytes], length: int | None, max_bytes: int = 1000) -> bytearray:
    return asyncio.run(read_body(chunks, length, max_bytes))


def _refused(chunks: AsyncIterator[bytes], length: int | None, max_bytes: int = 1000) -> WireError:
    with pytest.raises(WireError) as caught:
        _read(chunks, length, max_bytes)
    return caught.value


def test_exact_fill_from_uneven_chunks() -> None:
    parts = [b"ab", b"", b"cde", b"f" * 10, b"g"]
    body = _read(_chunks(parts), 16)
    assert isinstance(body, bytearray)
    assert body == b"".join(parts)
    body.extend(b"!")  # no live memoryview pins the buffer


def test_empty_body() -> None:
    assert _read(_chunks([]), 0) == bytearray()
    assert _read(_chunks([b""]), 0) == bytearray()


def test_body_of_exactly_the_limit_is_accepted() -> None:
    assert len(_read(_chunks([b"x" * 1000]), 1000, max_bytes=1000)) == 1000


def test_missing_content_length_is_411_before_reading() -> None:
    error = _refused(_must_not_be_read(), None)
    assert (error.status, error.kind) == (411, "length_required")


def test_too_large_is_413_before_reading() -> None:
    error = _refused(_must_not_be_read(), 1001, max_bytes=1000)
    assert (error.status, error.kind) == (413, "body_too_large")
    assert error.detail == {"content_length": 1001, "max_bytes": 1000}
    assert "1001" in error.error and "1000" in error.error


def test_short_body() -> None:
    error = _refused(_chunks([b"abc", b"de"]), 8)
    assert (error.status, error.kind) == (422, "invalid_request")
    assert error.error == "the body ended after 5 of 8 bytes"


def test_long_body() -> None:
    error = _refused(_chunks([b"abc", b"def"]), 4)
    assert (error.status, error.kind) == (422, "invalid_request")
    assert "longer than its Content-Length of 4 bytes" in error.error


def test_negative_length_passed_directly() -> None:
    assert _refused(_must_not_be_read(), -1).kind == "invalid_request"


@pytest.mark.parametrize(("header", "value"), [(None, None), ("0", 0), (" 123 ", 123)])
def test_parse_content_length(header: str | None, value: int | None) -> None:
    assert parse_content_length(header) == value


@pytest.mark.parametrize("header", ["", "-1", "+5", "1_000", "1.5", "abc", "12 34", "9" * 31])
def test_parse_content_length_refuses_non_integers(header: str) -> None:
    with pytest.raises(WireError) as caught:
        parse_content_length(header)
    assert (caught.value.status, caught.value.kind) == (422, "invalid_request")
    assert "Content-Length" in caught.value.error
