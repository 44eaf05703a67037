"""The worker's anchor: a coded delta moves a copy of it, which then becomes the anchor."""

from __future__ import annotations

import torch

from diloco.algorithm.codecs import parse_codec
from diloco.wire.compressed.body import encode_compressed
from diloco.worker.anchor import Anchor


def _anchor() -> Anchor:
    model = torch.nn.Linear(4, 2)
    anchor = Anchor(model, leader=True, download_dtype=torch.float32)
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0).view(2, 4))
        model.bias.copy_(torch.tensor([1.0, -1.0]))
    anchor.adopt(model.state_dict(), 0)
    return anchor


def test_a_delta_moves_a_copy_that_becomes_the_anchor_and_the_old_anchor_the_next_copy() -> None:
    """int8 of a block whose largest magnitude is 127 has scale 1, so each value is coded as
    itself rounded half to even: the new anchor is the old one plus those, by hand."""
    codec = parse_codec("int8")
    anchor = _anchor()
    names = list(anchor.tensors)
    delta = {"weight": torch.arange(-3.0, 5.0).view(2, 4) * (127 / 4), "bias": torch.zeros(2)}
    delta["weight"].view(-1)[0] = -127.0  # the block's largest magnitude: scale 1, exact
    body = encode_compressed(delta, codec)
    first = anchor.tensors
    moved = anchor.values_after(body, names, codec, coded=names)
    assert torch.equal(first["weight"], torch.arange(8.0).view(2, 4))  # the anchor stands
    expected = torch.arange(8.0).view(2, 4) + torch.round(delta["weight"])
    assert torch.equal(moved["weight"], expected)
    anchor.adopt(moved, 1)
    assert anchor.tensors is moved and anchor.round == 1
    assert torch.equal(anchor.model.weight.detach(), expected)
    # the next delta's copy goes into the old anchor's memory: no new allocation
    old_pointer = first["weight"].data_ptr()
    again = anchor.values_after(body, names, codec, coded=names)
    assert again["weight"].data_ptr() == old_pointer
    assert torch.equal(again["weight"], expected + torch.round(delta["weight"]))
    assert torch.equal(anchor.tensors["weight"], expected)  # until adopted


def test_a_copy_never_adopted_leaves_the_anchor_and_the_next_round_as_they_were() -> None:
    """The exchange failed after the delta was applied: the anchor keeps its values, and
    weights adopted from elsewhere (a full download) are copied into it, not swapped."""
    codec = parse_codec("int8")
    anchor = _anchor()
    names = list(anchor.tensors)
    body = encode_compressed({"weight": torch.full((2, 4), 127.0), "bias": torch.zeros(2)}, codec)
    kept = anchor.tensors
    anchor.values_after(body, names, codec, coded=names)  # computed, then dropped
    sent = {"weight": torch.full((2, 4), 0.5), "bias": torch.tensor([2.0, 3.0])}
    anchor.adopt(sent, 3)
    assert anchor.tensors is kept and torch.equal(kept["weight"], sent["weight"])
    assert anchor.tensors["weight"] is not sent["weight"]


def test_a_delta_refused_part_way_leaves_the_anchor_as_it_was() -> None:
    """The copy is checked span by span as it moves: a NaN scale in the delta's last block
    is refused (422 naming the tensor) after the blocks before it moved the copy, and the
    anchor, its round and the next delta are untouched by it."""
    import pytest

    from diloco.wire import WireError
    from diloco.wire.format.frames import decode_frame

    codec = parse_codec("int8", block=8)
    anchor = _anchor()
    names = list(anchor.tensors)
    delta = {"weight": torch.ones(2, 4), "bias": torch.ones(2)}
    good = encode_compressed(delta, codec)
    bad = bytearray(good)
    parts, _ = decode_frame(bad)  # views of `bad`
    (scales,) = [t for name, t in parts.items() if name.startswith("bias") and "scales" in name]
    scales[-1] = float("nan")
    before = {n: t.clone() for n, t in anchor.tensors.items()}
    with pytest.raises(WireError) as refused:
        anchor.values_after(bad, names, codec, coded=names)
    assert refused.value.status == 422 and "bias" in str(refused.value)
    assert all(torch.equal(anchor.tensors[n], before[n]) for n in names) and anchor.round == 0
    moved = anchor.values_after(good, names, codec, coded=names)
    assert torch.equal(moved["weight"], before["weight"] + 1)
