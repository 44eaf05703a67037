"""The header of a body, checked from its first chunks however they are cut."""

from __future__ import annotations

import anyio
import pytest
import torch

from diloco.wire import EarlyHeader, WireError, encode_tensors
from diloco.wire.frames import parse_frame_header

TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}


@pytest.mark.parametrize("cut", [1, 3, 8, 9, 50, 10_000])
def test_the_header_is_checked_once_whole_whatever_the_chunks(cut):
    body = bytes(encode_tensors(TENSORS))
    seen = []

    async def feed() -> int:
        early = EarlyHeader(len(body), lambda shapes: seen.append(dict(shapes)))
        for start in range(0, len(body), cut):
            if not early.done:
                await early.feed(body[start : start + cut])
                if early.done:
                    return start + cut
        return len(body)

    read_when_checked = anyio.run(feed)
    header_end = parse_frame_header(body, len(body))[0]
    assert read_when_checked < header_end + cut + 1  # not later than the chunk that ended it
    ((shapes),) = seen
    assert {name: (tuple(t.shape), t.dtype) for name, t in shapes.items()} == {
        "a": ((2, 3), torch.float32),
        "b": ((2,), torch.int64),
    }


def test_a_refusal_from_the_check_or_a_bad_header_is_raised_at_once():
    body = bytes(encode_tensors(TENSORS))

    def refuse(_shapes):
        raise WireError(422, "wrong_shape", "no")

    header_end = parse_frame_header(body, len(body))[0]
    with pytest.raises(WireError) as refused:
        anyio.run(EarlyHeader(len(body), refuse).feed, body[:header_end])
    assert refused.value.kind == "wrong_shape"
    too_long = (1 << 40).to_bytes(8, "little")  # a header longer than the body
    with pytest.raises(WireError) as malformed:
        anyio.run(EarlyHeader(len(body)).feed, too_long)
    assert malformed.value.kind == "malformed_safetensors"
