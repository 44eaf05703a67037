"""The worker's anchor: a coded delta moves it in place; one that fails part way leaves it torn
until whole weights are adopted; a streaming fragment's delta moves copies."""

from __future__ import annotations

import torch

from diloco.algorithm.compression.codecs import parse_codec
from diloco.wire.compressed.body import encode_compressed
from diloco.worker.anchor import Anchor, anchor_copies


def _anchor() -> Anchor:
    model = torch.nn.Linear(4, 2)
    anchor = Anchor(model, leader=True, download_dtype=torch.float32)
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0).view(2, 4))
        model.bias.copy_(torch.tensor([1.0, -1.0]))
    anchor.adopt(model.state_dict(), 0)
    return anchor


def test_a_delta_moves_the_anchor_in_place_and_adopting_it_keeps_its_memory() -> None:
    """int8 of a block whose largest magnitude is 127 has scale 1, so each value is coded as
    itself rounded half to even: the new anchor is the old one plus those, by hand."""
    codec = parse_codec("int8")
    anchor = _anchor()
    names = list(anchor.tensors)
    delta = {"weight": torch.arange(-3.0, 5.0).view(2, 4) * (127 / 4), "bias": torch.zeros(2)}
    delta["weight"].view(-1)[0] = -127.0  # the block's largest magnitude: scale 1, exact
    body = encode_compressed(delta, codec)
    pointer = anchor.tensors["weight"].data_ptr()
    moved = anchor.values_after(body, names, codec, coded=names, in_place=True)
    expected = torch.arange(8.0).view(2, 4) + torch.round(delta["weight"])
    assert moved is anchor.tensors and moved["weight"].data_ptr() == pointer  # no copy
    assert torch.equal(moved["weight"], expected) and not anchor.torn
    anchor.adopt(moved, 1)
    assert anchor.tensors is moved and anchor.round == 1
    assert torch.equal(anchor.model.weight.detach(), expected)
    again = anchor.values_after(body, names, codec, coded=names, in_place=True)
    assert again["weight"].data_ptr() == pointer
    assert torch.equal(again["weight"], expected + torch.round(delta["weight"]))


def test_weights_adopted_from_elsewhere_are_copied_into_the_anchor_not_swapped() -> None:
    """A full download (a torn anchor's repair, a rebase) is written over the anchor's own
    memory: the anchor never holds the download's tensors."""
    anchor = _anchor()
    kept = anchor.tensors
    sent = {"weight": torch.full((2, 4), 0.5), "bias": torch.tensor([2.0, 3.0])}
    anchor.adopt(sent, 3)
    assert anchor.tensors is kept and torch.equal(kept["weight"], sent["weight"])
    assert anchor.tensors["weight"] is not sent["weight"] and anchor.round == 3


def _nan_in_the_last_block(codec, delta: dict[str, torch.Tensor]) -> tuple[bytearray, bytearray]:
    """(a good body, the same body with a NaN scale in the bias's last block)."""
    from diloco.wire.format.frames import decode_frame

    good = encode_compressed(delta, codec)
    bad = bytearray(good)
    parts, _ = decode_frame(bad)  # views of `bad`
    (scales,) = [t for name, t in parts.items() if name.startswith("bias") and "scales" in name]
    scales[-1] = float("nan")
    return good, bad


def test_a_delta_refused_part_way_leaves_the_anchor_torn_until_whole_weights_come() -> None:
    """A NaN scale in the delta's last block is refused (422 naming the tensor) after the
    blocks before it moved the anchor: the anchor says it is torn, its round is the old one,
    and adopting whole weights mends it."""
    import pytest

    from diloco.wire import WireError

    codec = parse_codec("int8", block=8)
    anchor = _anchor()
    names = list(anchor.tensors)
    good, bad = _nan_in_the_last_block(codec, {"weight": torch.ones(2, 4), "bias": torch.ones(2)})
    with pytest.raises(WireError) as refused:
        anchor.values_after(bad, names, codec, coded=names, in_place=True)
    assert refused.value.status == 422 and "bias" in str(refused.value)
    assert anchor.torn and anchor.round == 0
    with pytest.raises(AssertionError, match="torn anchor"):
        anchor.pseudo_gradient()
    whole = {"weight": torch.arange(8.0).view(2, 4), "bias": torch.tensor([1.0, -1.0])}
    anchor.adopt(whole, 1)
    assert not anchor.torn and anchor.round == 1
    moved = anchor.values_after(good, names, codec, coded=names, in_place=True)
    assert torch.equal(moved["weight"], whole["weight"] + 1)
    assert torch.equal(moved["bias"], whole["bias"] + 1)


def test_a_fragment_delta_refused_part_way_leaves_the_anchor_as_it_was() -> None:
    """A streaming fragment's delta moves copies of the fragment's tensors: a refusal leaves
    the anchor whole and untouched."""
    import pytest

    from diloco.wire import WireError

    codec = parse_codec("int8", block=8)
    anchor = _anchor()
    before = {n: t.clone() for n, t in anchor.tensors.items()}
    _, bad = _nan_in_the_last_block(codec, {"bias": torch.ones(2)})
    with pytest.raises(WireError):
        anchor.values_after(bad, ["bias"], codec, coded=["bias"])
    assert not anchor.torn
    assert all(torch.equal(anchor.tensors[n], before[n]) for n in before)


def test_the_anchor_device_counts_only_the_model_sized_copies_a_round_makes() -> None:
    """Counted by hand from what each path allocates: fp32 and int8 write anchor - local
    into the body (the anchor alone); bf16 codes a whole pseudo-gradient; a residual brings
    its spare; a streaming fragment's delta moves a copy, a sync delta the anchor itself."""
    fp32, bf16, int8 = parse_codec("fp32"), parse_codec("bf16"), parse_codec("int8")
    topk = parse_codec("topk:0.03+int2")
    assert anchor_copies(fp32, 0.95, fp32, streaming=False) == 1  # fp32 keeps no residual
    assert anchor_copies(int8, 0.0, int8, streaming=False) == 1
    assert anchor_copies(int8, 0.0, int8, streaming=True) == 2
    assert anchor_copies(bf16, 0.0, fp32, streaming=True) == 2
    assert anchor_copies(int8, 0.95, fp32, streaming=False) == 3
    assert anchor_copies(topk, 0.95, parse_codec("int2"), streaming=True) == 4
    assert anchor_copies(bf16, 0.95, int8, streaming=True) == 5


def test_a_fragment_s_new_values_are_copied_into_its_anchor_s_own_tensors() -> None:
    """A streaming fragment's coded delta moves copies (the anchor untouched until the merge),
    and the merge copies them into the anchor's own tensors: the anchor keeps its memory
    (taking the copies as the anchor cost a CPU worker memory and time:
    benchmarks/results/model_scale-fragment-adopt/). Values by hand: int8 with a block whose
    largest magnitude is 127 (scale 1), each value rounded half to even."""
    codec = parse_codec("int8")
    anchor = _anchor()
    delta = {"weight": torch.arange(-3.0, 5.0).view(2, 4) * (127 / 4)}
    delta["weight"].view(-1)[0] = -127.0
    body = encode_compressed(delta, codec)
    own, bias = anchor.tensors["weight"], anchor.tensors["bias"]
    first = anchor.values_after(body, ["weight"], codec, coded=["weight"])
    step = torch.round(delta["weight"])
    assert first["weight"] is not own and torch.equal(own, torch.arange(8.0).view(2, 4))
    anchor.adopt_fragment(first)
    assert anchor.tensors["weight"] is own  # copied in, not taken
    assert torch.equal(own, torch.arange(8.0).view(2, 4) + step)
    first["weight"].zero_()  # the copy is the caller's: the anchor does not follow it
    assert torch.equal(own, torch.arange(8.0).view(2, 4) + step)
    second = anchor.values_after(body, ["weight"], codec, coded=["weight"])
    assert torch.equal(second["weight"], torch.arange(8.0).view(2, 4) + 2 * step)
    anchor.adopt_fragment(second)
    assert anchor.tensors["weight"] is own
    assert torch.equal(own, torch.arange(8.0).view(2, 4) + 2 * step)
    sent = {"bias": torch.tensor([4.0, 5.0])}  # (a plain download's values)
    anchor.adopt_fragment(sent)
    assert anchor.tensors["bias"] is bias and torch.equal(bias, sent["bias"])
