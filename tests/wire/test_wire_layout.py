"""FrameLayout and FrameBuffer: the bytes encode_tensors writes, views into them, and loans."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from diloco.wire import decode_tensors, encode_tensors
from diloco.wire.format.layout import FrameBuffer, FrameLayout


def sample() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(7, 5, generator=generator),
        "half": torch.randn(3, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor([4, -2, 9], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


@pytest.mark.parametrize("float_dtype", [None, torch.float32, torch.bfloat16])
def test_a_filled_buffer_holds_exactly_the_bytes_encode_tensors_writes(float_dtype) -> None:
    tensors = sample()
    layout = FrameLayout.of(tensors, float_dtype)
    frame = FrameBuffer(layout)
    frame.fill(tensors)
    expected = encode_tensors(tensors, float_dtype=float_dtype)
    assert frame.nbytes == layout.size == len(expected)
    assert bytes(frame.lend()) == bytes(expected)
    reloaded = load(bytes(frame.lend()))  # the reference reader agrees
    for name, tensor in tensors.items():
        wanted = tensor.to(float_dtype) if float_dtype and tensor.is_floating_point() else tensor
        assert torch.equal(reloaded[name], wanted), name


def test_slots_go_widest_first_and_are_aligned() -> None:
    layout = FrameLayout.of(sample())
    order = sorted(layout.slots.items(), key=lambda item: item[1].start)
    widths = [slot.dtype.itemsize for _, slot in order]
    assert widths == sorted(widths, reverse=True)
    assert all(slot.start % slot.dtype.itemsize == 0 for slot in layout.slots.values())
    assert len(layout.header) % 8 == 0


def test_views_write_through_to_the_bytes() -> None:
    tensors = {"a": torch.zeros(4), "n": torch.zeros(2, dtype=torch.int32)}
    frame = FrameBuffer(FrameLayout.of(tensors))
    frame.fill(tensors)
    frame.views["a"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    frame.views["n"].fill_(-7)
    decoded = decode_tensors(frame.lend())
    assert decoded["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert decoded["n"].tolist() == [-7, -7]


def test_a_loan_lasts_as_long_as_any_view_made_from_it() -> None:
    frame = FrameBuffer(FrameLayout.of({"a": torch.ones(10)}))
    assert not frame.lent
    view = frame.lend()
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    part = view[8:16]  # a slice, as a transport keeps of what it has not sent yet
    again = memoryview(part)
    del view, part
    assert frame.lent
    del again
    assert not frame.lent
    first, second = frame.lend(), frame.lend()
    del first
    assert frame.lent
    del second
    assert not frame.lent


def test_wire_dtypes_only_and_bodies_of_the_right_size_only() -> None:
    with pytest.raises(ValueError):
        FrameLayout.of({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="'x'"):
        FrameLayout.of({"x": [1.0, 2.0]})  # type: ignore[dict-item]
    layout = FrameLayout.of({"a": torch.ones(3)})
    with pytest.raises(ValueError, match="uint8"):
        layout.views(torch.zeros(layout.size + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        layout.views(torch.zeros(layout.size, dtype=torch.int8))
