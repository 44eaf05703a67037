"""A compressed body read as decoded pieces (wire/compressed/pieces.py), from a spool file and
from memory: the same values as decoding it whole, every malformed value refused before it is
handed on, a bound of the magnitudes from the scales, and memory of one span, not the model."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from diloco.algorithm import RunningMean
from diloco.algorithm.compression.codecs import Codec, parse_codec, piece_elements
from diloco.algorithm.tensors import SparsePiece
from diloco.wire import WireError
from diloco.wire.compressed.bitpack import pack, unpack
from diloco.wire.compressed.body import (
    check_compressed_header,
    decode_compressed,
    encode_compressed,
)
from diloco.wire.compressed.pieces import CompressedPieces
from diloco.wire.format.frames import decode_frame, read_frame_header
from diloco.wire.format.spool import SpooledTensors, SpoolFiles
from frames import frame_of

CODECS = ["int8", "int4", "int2", "topk:0.03+int2", "topk:0.1", "topk:0.5+bf16"]


def tensors(big: int = 300_000) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(big, generator=generator),  # more than one span
        "odd": torch.randn(13, generator=generator),  # a short last block and chunk
        "empty": torch.zeros(0),
        "steps": torch.tensor([1, -2], dtype=torch.int64),  # sent exact
        "norm": torch.tensor([0.5, -2.0]),  # a float sent exact
    }


def expected_of(values: dict[str, torch.Tensor]) -> dict:
    return {name: (tuple(t.shape), t.dtype) for name, t in values.items()}


def spooled_of(data: bytes | bytearray) -> SpooledTensors:
    file = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the spooled body)
    file.write(data)
    file.flush()
    data_start, entries, metadata = read_frame_header(bytes(data[: 1 << 16]), len(data))
    return SpooledTensors(file, len(data), data_start, entries, SpoolFiles(keep=0), metadata)


def both(data: bytes | bytearray, expected: dict, codec: Codec) -> list[CompressedPieces]:
    """The body as decoded pieces from a spool file and from memory."""
    spooled = spooled_of(data)
    header = check_compressed_header(
        spooled.entries, spooled.metadata, expected, codec, exact={"norm"}
    )
    in_file = CompressedPieces.spooled(header, spooled)
    parts, metadata = decode_frame(bytearray(data))
    header = check_compressed_header(parts, metadata, expected, codec, exact={"norm"})
    return [in_file, CompressedPieces.in_memory(header)]


def assembled(body: CompressedPieces) -> dict[str, torch.Tensor]:
    out = {name: torch.full((t.numel(),), math.nan) for name, t in body.meta.items()}
    for name, first, piece in body.pieces():
        assert bool(torch.isnan(out[name][first : first + piece.numel()]).all())  # once each
        out[name][first : first + piece.numel()] = piece
    return out


def coded(spec: str) -> tuple[Codec, dict, bytearray, dict, dict]:
    """The codec, the values, their body, what a receiver expects and the body decoded whole."""
    codec = parse_codec(spec, block=64, chunk=32)
    values = tensors()
    data = encode_compressed(values, codec, exact={"norm"})
    expected = expected_of(values)
    return codec, values, data, expected, decode_compressed(data, expected, codec, exact={"norm"})


@pytest.mark.parametrize("spec", CODECS)
def test_the_pieces_are_the_whole_decode_from_a_file_and_from_memory(spec: str) -> None:
    codec, values, data, expected, whole = coded(spec)
    for body in both(data, expected, codec):
        meta = body.meta
        assert {n: (tuple(t.shape), t.dtype) for n, t in meta.items()} == {
            **{n: (tuple(t.shape), torch.float32) for n, t in values.items()},
            "steps": ((2,), torch.int64),
        }
        bound = body.check_values()
        got = assembled(body)
        for name, tensor in whole.items():
            assert torch.equal(got[name].view(tensor.shape).to(tensor.dtype), tensor), name
        assert bound >= float(whole["big"].abs().max()) and body.largest == "big"
        assert body.nbytes == len(data) - read_frame_header(bytes(data), len(data))[0]
        body.close()


@pytest.mark.parametrize("spec", ["topk:0.03+int2", "topk:0.1"])
def test_sparse_pieces_are_the_kept_values_of_the_whole_decode(spec: str) -> None:
    """Asked for sparse pieces, a top-k tensor comes as its kept values (a SparsePiece per
    span of up to 2^23 elements: 'big', 300k, in one), whose dense form is the whole decode;
    tensors sent exact come as plain pieces; without asking, every piece is dense."""
    codec, values, data, expected, whole = coded(spec)
    for body in both(data, expected, codec):
        seen = []
        for name, first, piece in body.pieces(sparse=True):  # each used before the next
            seen.append((name, first))
            if name in ("big", "odd"):
                assert isinstance(piece, SparsePiece) and piece.numel() == values[name].numel()
                assert torch.equal(piece.dense(), whole[name]), name
            else:  # exact: a plain piece
                assert not isinstance(piece, SparsePiece)
                assert torch.equal(piece, values[name]), name
        assert ("big", 0) in seen and len([s for s in seen if s[0] == "big"]) == 1
        dense = [isinstance(p, SparsePiece) for _, _, p in body.pieces()]
        assert not any(dense)  # unless asked
        body.close()


def test_sparse_pieces_of_many_spans_cover_a_tensor_once_and_check_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With pieces of 64 values, topk:0.1 (k = 3 of 32) reads spans of at most 64 x 32 // 3 =
    682 elements, in whole groups of 8 chunks (so that 8 x 3 indices of 5 bits fill whole
    bytes): 512. 'big' (300k) comes in 586 sparse pieces from first = 0 on, each its slice of
    the whole decode (the last of 3 chunks); an index that repeats in a later span is refused
    naming its chunk."""
    import diloco.algorithm.compression.codecs as codecs

    monkeypatch.setattr(codecs, "_CPU_PIECE", 64)
    codec, _, data, expected, whole = coded("topk:0.1")
    assert codec.k == 3 and codecs.read_elements(codec, torch.device("cpu")) == 682
    for body in both(data, expected, codec):
        firsts = []
        for name, first, piece in body.pieces(sparse=True):
            if name != "big":
                continue
            firsts.append(first)
            expect = whole["big"].reshape(-1)[first : first + piece.numel()]
            assert torch.equal(piece.dense(), expect), first
        assert firsts == list(range(0, 300_000, 512)) and len(firsts) == 586
        body.close()

    def repeat(parts: dict) -> None:  # chunk 1000 (in span 62): its second index = its first
        indices = unpack(parts["big#indices"], 5, 300_000 // 32 * 3)
        indices[1000 * 3 + 1] = indices[1000 * 3]
        parts["big#indices"] = pack(indices, 5)

    data, expected = body_with(codec, repeat)
    for body in both(data, expected, codec):
        with pytest.raises(WireError) as refused:
            list(body.pieces(sparse=True))
        assert refused.value.detail["chunk"] == 1000 and "repeats index" in str(refused.value)


def body_with(codec: Codec, change) -> tuple[bytes, dict]:
    """A valid body with one part of 'big' changed by `change(parts)`."""
    values = tensors()
    data = encode_compressed(values, codec, exact={"norm"})
    parts, metadata = decode_frame(data)
    parts = {name: t.clone() for name, t in parts.items()}
    change(parts)
    return bytes(frame_of(parts, metadata)), expected_of(values)


def test_a_bad_scale_in_the_last_span_is_refused_and_a_first_fold_leaves_nothing() -> None:
    """The checked one-pass fold of a round's first contribution: the spans before the NaN
    were written into the sums' storage, but the running mean registers nothing."""
    codec = Codec("int8", block=64)

    def poison(parts: dict) -> None:
        parts["big#scales"][-1] = math.nan

    data, expected = body_with(codec, poison)
    for body in both(data, expected, codec):
        with pytest.raises(WireError) as refused:
            body.check_values()
        detail = refused.value.detail
        assert refused.value.kind == "malformed_compressed"
        assert (detail["tensor"], detail["part"]) == ("big", "scales")
        assert detail["block"] == math.ceil(300_000 / 64) - 1
        running = RunningMean(storage={"big": torch.zeros(300_000)})
        shapes = {name: tuple(t.shape) for name, t in body.meta.items()}
        with pytest.raises(WireError):
            running.add_pieces(shapes, body.checked_pieces(), tokens=1)
        assert running.count == 0 and running.sums == {} and running.bound == 0.0


def test_the_overflow_bound_comes_from_the_scales() -> None:
    """int8 decodes to at most 127 x the largest scale: a limit below it is sum_overflow."""
    codec = Codec("int8", block=64)
    values = {"big": torch.tensor([3.0, -1.0] * 32)}  # one block, s = 3 / 127
    data = encode_compressed(values, codec)
    for body in both(data, expected_of(values), codec):
        assert body.check_values() == pytest.approx(3.0)
        with pytest.raises(WireError) as refused:
            list(body.checked_pieces(limit=2.0))
        assert refused.value.kind == "sum_overflow" and refused.value.detail["tensor"] == "big"


def test_memory_is_one_span_whatever_the_tensor() -> None:
    """4M elements in int8 from a file: the reader's buffers hold one span (2 MiB of fp32 and
    its codes and scales), not the tensor's 16 MiB."""
    codec = Codec("int8", block=128)
    values = {"big": torch.randn(4 << 20)}
    data = encode_compressed(values, codec)
    (body, _) = both(data, expected_of(values), codec)
    for _ in body.pieces():
        pass
    span = piece_elements(torch.device("cpu"))
    assert body._out.numel() <= span
    assert sum(len(buffer) for buffer in body._scratch.values()) <= span + 4 * span // 128
    body.close()
