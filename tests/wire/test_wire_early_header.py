"""The header of a body, checked from its first chunks however they are cut."""

from __future__ import annotations

import anyio
import pytest
import torch

from diloco.algorithm.codecs import Codec
from diloco.wire import EarlyHeader, WireError, encode_tensors
from diloco.wire.compressed.body import codec_metadata, encode_compressed
from diloco.wire.format.frames import parse_frame_header

TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}


@pytest.mark.parametrize("cut", [1, 3, 8, 9, 50, 10_000])
def test_the_header_is_checked_once_whole_whatever_the_chunks(cut):
    body = bytes(encode_tensors(TENSORS))
    seen = []

    async def feed() -> int:
        early = EarlyHeader(len(body), lambda shapes, meta: seen.append((dict(shapes), meta)))
        for start in range(0, len(body), cut):
            if not early.done:
                await early.feed(body[start : start + cut])
                if early.done:
                    return start + cut
        return len(body)

    read_when_checked = anyio.run(feed)
    header_end = parse_frame_header(body, len(body))[0]
    assert read_when_checked < header_end + cut + 1  # not later than the chunk that ended it
    ((shapes, metadata),) = seen
    assert metadata == {}
    assert {name: (tuple(t.shape), t.dtype) for name, t in shapes.items()} == {
        "a": ((2, 3), torch.float32),
        "b": ((2,), torch.int64),
    }


def test_a_refusal_from_the_check_or_a_bad_header_is_raised_at_once():
    body = bytes(encode_tensors(TENSORS))

    def refuse(_shapes, _metadata):
        raise WireError(422, "wrong_shape", "no")

    header_end = parse_frame_header(body, len(body))[0]
    with pytest.raises(WireError) as refused:
        anyio.run(EarlyHeader(len(body), refuse).feed, body[:header_end])
    assert refused.value.kind == "wrong_shape"
    too_long = (1 << 40).to_bytes(8, "little")  # a header longer than the body
    with pytest.raises(WireError) as malformed:
        anyio.run(EarlyHeader(len(body)).feed, too_long)
    assert malformed.value.kind == "malformed_safetensors"


def test_the_check_sees_the_metadata_of_a_compressed_body():
    """A compressed body's codec is in its header's __metadata__: the early check sees it, so a
    body coded otherwise is refused before its parts are read."""
    codec = Codec("int8", block=8)
    body = bytes(encode_compressed({"a": torch.arange(16.0)}, codec))
    seen = []
    early = EarlyHeader(len(body), lambda shapes, metadata: seen.append((dict(shapes), metadata)))
    anyio.run(early.feed, body[: parse_frame_header(body, len(body))[0]])
    ((shapes, metadata),) = seen
    assert metadata == codec_metadata(codec)
    assert {name: tuple(t.shape) for name, t in shapes.items()} == {
        "a#codes": (16,),
        "a#scales": (2,),
    }
    assert early.header is not None and early.header[2] == codec_metadata(codec)
