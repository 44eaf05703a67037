"""Bodies spooled to disk read back exactly, in bounded pieces, with the same rejections."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from diloco.algorithm import Contribution, RunningMean
from diloco.wire import SpoolFiles, WireError, decode_tensors, encode_tensors, spool_body


async def _chunks(data: bytes, size: int = 7000):
    for start in range(0, len(data), size):
        yield data[start : start + size]


def spool(data: bytes, length: int | None = None, max_bytes: int = 10**9):
    return asyncio.run(
        spool_body(_chunks(data), len(data) if length is None else length, max_bytes)
    )


def sample() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(300, 7, generator=generator),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
        "n": torch.tensor([3, -4], dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
    }


def test_pieces_reassemble_every_tensor_exactly() -> None:
    tensors = sample()
    spooled = spool(bytes(encode_tensors(tensors)))
    assert {n: tuple(t.shape) for n, t in spooled.meta.items()} == {
        n: tuple(t.shape) for n, t in tensors.items()
    }
    rebuilt = {n: torch.empty(t.numel(), dtype=t.dtype) for n, t in tensors.items()}
    for name, first, piece in spooled.pieces(piece_bytes=64):  # many small pieces
        assert piece.numel() * piece.element_size() <= 64
        rebuilt[name][first : first + piece.numel()] = piece
    for name, tensor in tensors.items():
        assert torch.equal(rebuilt[name].view(tensor.shape), tensor), name
    spooled.check_values()
    spooled.close()


def test_folding_pieces_equals_folding_tensors() -> None:
    tensors = {"w": torch.randn(1000), "v": torch.randn(3, 4)}
    body = bytes(encode_tensors(tensors))
    whole, pieced = RunningMean("tokens"), RunningMean("tokens")
    whole.add(Contribution(decode_tensors(body), tokens=3))
    whole.add(Contribution({n: t * 2 for n, t in tensors.items()}, tokens=1))
    whole_mean = whole.mean()
    spooled = spool(body)
    shapes = {n: tuple(t.shape) for n, t in spooled.meta.items()}
    assert pieced.add_pieces(shapes, spooled.pieces(piece_bytes=128), tokens=3)
    pieced.add(Contribution({n: t * 2 for n, t in tensors.items()}, tokens=1))
    pieced_mean = pieced.mean()
    for name, tensor in tensors.items():  # (3 t + 1 * 2 t) / 4, bit for bit the same path
        assert torch.equal(pieced_mean[name], whole_mean[name]), name
        torch.testing.assert_close(pieced_mean[name], 5 * tensor / 4)


def test_nan_anywhere_is_named_with_its_tensor() -> None:
    tensors = {"a": torch.zeros(100), "b": torch.zeros(50)}
    tensors["b"][37] = float("nan")
    spooled = spool(bytes(encode_tensors(tensors)))
    with pytest.raises(WireError) as caught:
        spooled.check_values()
    assert caught.value.status == 422 and caught.value.kind == "non_finite"
    assert "'b'" in caught.value.error and caught.value.detail["count"] == 1


def test_length_rules_match_read_body() -> None:
    data = bytes(encode_tensors({"a": torch.zeros(10)}))
    with pytest.raises(WireError) as missing:
        asyncio.run(spool_body(_chunks(data), None, 10**6))
    assert missing.value.status == 411
    with pytest.raises(WireError) as too_big:
        asyncio.run(spool_body(_chunks(data), len(data), 10))
    assert too_big.value.status == 413
    with pytest.raises(WireError, match="ended after"):
        spool(data[:-5], length=len(data))  # cut short (its header was whole and consistent)
    with pytest.raises(WireError, match="longer than its Content-Length"):
        spool(data, length=len(data) - 5)


def test_a_malformed_header_is_refused_and_the_file_is_gone() -> None:
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(WireError) as caught:
        spool(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert caught.value.kind == "malformed_safetensors"
    assert set(os.listdir("/proc/self/fd")) <= before  # the temporary file was closed


# -- kept files ----------------------------------------------------------------------------------


def spool_into(files: SpoolFiles, data: bytes, length: int | None = None):
    return asyncio.run(
        spool_body(_chunks(data), len(data) if length is None else length, 10**9, files=files)
    )


def test_a_kept_file_is_written_over_and_only_the_new_body_is_read() -> None:
    files = SpoolFiles(keep=2)
    large = spool_into(files, bytes(encode_tensors({"w": torch.full((5000,), float("nan"))})))
    large_file = large.file
    large.close()
    large.close()  # idempotent: the file is given back once
    assert files.idle == 1
    small_tensors = {"w": torch.arange(10, dtype=torch.float32), "n": torch.tensor([7, 8])}
    small = spool_into(files, bytes(encode_tensors(small_tensors)))
    assert small.file is large_file and files.idle == 0  # the same file, reused
    small.check_values()  # the stale NaNs after the new body are never read
    rebuilt = {n: torch.empty(t.numel(), dtype=t.dtype) for n, t in small_tensors.items()}
    for name, first, piece in small.pieces():
        rebuilt[name][first : first + piece.numel()] = piece
    for name, tensor in small_tensors.items():
        assert torch.equal(rebuilt[name], tensor), name
    small.close()
    with pytest.raises(ValueError, match="closed"):
        next(small.pieces())


def test_a_refused_body_gives_its_file_back() -> None:
    files = SpoolFiles(keep=2)
    data = bytes(encode_tensors({"a": torch.zeros(10)}))
    with pytest.raises(WireError, match="ended after"):
        spool_into(files, data[:-5], length=len(data))
    with pytest.raises(WireError) as caught:
        spool_into(files, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert caught.value.kind == "malformed_safetensors"
    assert files.idle == 1  # both refusals used, then returned, the one file
    good = spool_into(files, data)
    good.check_values()
    good.close()


def test_files_beyond_keep_are_closed() -> None:
    files = SpoolFiles(keep=1)
    data = bytes(encode_tensors({"a": torch.zeros(10)}))
    first, second = spool_into(files, data), spool_into(files, data)
    assert first.file is not second.file
    first.close()
    second.close()
    assert files.idle == 1 and not first.file.closed and second.file.closed


def test_the_check_returns_a_bound_of_every_magnitude() -> None:
    tensors = sample()
    tensors["w"][17, 3] = -250.0  # the largest magnitude, in the middle of a tensor
    spooled = spool(bytes(encode_tensors(tensors)))
    bound = spooled.check_values()
    assert bound >= 250.0
    assert bound < 1e6  # a bound a running sum can use: sqrt of the sum of squares, doubled
    spooled.close()
