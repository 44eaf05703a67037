"""The header of a body, checked from its first chunks however they are cut."""

from __future__ import annotations

import anyio
import pytest
import torch

from diloco.algorithm.compression.codecs import Codec
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


def test_a_header_longer_than_the_limit_is_refused_from_its_first_8_bytes():
    """Only the length is read: what follows is not even JSON, and the refusal names both
    figures. A header of exactly the limit is read and parsed as ever."""
    body = bytes(encode_tensors(TENSORS))
    header_len = int.from_bytes(body[:8], "little")
    too_long = EarlyHeader(10**9, max_header=header_len - 1)  # (a body that could hold it)
    with pytest.raises(WireError) as refused:
        anyio.run(too_long.feed, body[:8] + b"\xff" * 100)
    assert refused.value.status == 413 and refused.value.kind == "header_too_large"
    assert refused.value.detail == {"header_bytes": header_len, "limit": header_len - 1}
    assert f"is {header_len} bytes, over the {header_len - 1} bytes" in refused.value.error
    exact = EarlyHeader(len(body), max_header=header_len)
    anyio.run(exact.feed, body)
    assert exact.done and set(exact.header[1]) == {"a", "b"}


def test_a_length_the_body_cannot_hold_is_malformed_before_it_is_too_large():
    """A 100-byte header in a 20-byte body is 422 malformed_safetensors, whatever the limit."""
    with pytest.raises(WireError) as malformed:
        anyio.run(EarlyHeader(20, max_header=1).feed, (100).to_bytes(8, "little"))
    assert malformed.value.status == 422 and malformed.value.kind == "malformed_safetensors"


def test_long_non_ascii_names_stay_within_the_limit():
    """JSON escapes each non-ASCII character to 6 bytes, and the limit counts names so: 400
    tensors named with 130 CJK characters each, coded top-k (three entries a tensor, the
    most), take at most 3/4 of it; counted as UTF-8 bytes (3 a character) they would not
    fit (by hand: 4 x (390 + 160) = 2200 a tensor against the header's 3 x (780 + ~70))."""
    from diloco.algorithm.compression.codecs import parse_codec
    from diloco.wire import header_limit

    state = {f"{i:03d}" + "层" * 130: torch.zeros(300) for i in range(400)}
    body = encode_compressed(state, parse_codec("topk:0.03+int2"))
    header_len = int.from_bytes(body[:8], "little")
    assert header_len < 0.75 * header_limit(state), (header_len, header_limit(state))
    as_utf8 = 65536 + sum(4 * (len(name.encode()) + 160) for name in state)
    assert header_len > as_utf8  # what the first version of the limit would have refused


@pytest.mark.parametrize("codec", ["fp32", "int8", "int2", "topk:0.03+int2", "topk:0.0001"])
def test_every_body_of_a_model_has_under_half_its_header_limit(codec):
    """The limit is room to spare: the bundled GPT's bodies (53 tensors, names of up to 27
    characters) plain and in every kind of codec (offsets of up to 7 digits), and top-k with
    k = 1 a chunk (the most index entries), stay under half of it; so does one tensor with a
    name of 200 characters."""
    from diloco.algorithm.compression.codecs import parse_codec
    from diloco.models.gpt import GPTConfig
    from diloco.wire import header_limit

    state = GPTConfig(context=16, width=256, depth=4, heads=4).build().state_dict()
    state["x" * 200] = torch.zeros(3)
    floats = {n: t.float() for n, t in state.items()}
    if codec == "fp32":
        body = encode_tensors(state)
    else:
        body = encode_compressed(floats, parse_codec(codec))
    header_len = int.from_bytes(body[:8], "little")
    assert header_len < header_limit(state) / 2, (header_len, header_limit(state))
