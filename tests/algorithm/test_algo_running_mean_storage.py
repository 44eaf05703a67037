"""RunningMean with its sums in preallocated storage (the server's buffers, reused every round).

A name's first contribution is written over whatever the storage held; the sums must be
exactly those of a RunningMean that allocates its own, and senders' tensors are never written.
"""

from __future__ import annotations

import pytest
import torch

from diloco.algorithm import Contribution, RunningMean


def assert_identical(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        assert torch.equal(left[name], right[name]), name


def contributions() -> list[Contribution]:
    generator = torch.Generator().manual_seed(7)
    return [
        Contribution(
            {"w": torch.randn(4, 3, generator=generator), "n": torch.tensor([1.0, 2.0])},
            tokens=tokens,
        )
        for tokens in (1, 3, 2)
    ]


def pieces_of(contribution: Contribution, size: int = 5):
    for name, tensor in contribution.pseudo_gradient.items():
        flat = tensor.reshape(-1)
        for first in range(0, flat.numel(), size):
            yield name, first, flat[first : first + size]


@pytest.mark.parametrize("weighting", ["uniform", "tokens"])
@pytest.mark.parametrize("by_pieces", [False, True])
def test_sums_in_storage_are_written_over_garbage_and_equal_fresh_ones(
    weighting: str, by_pieces: bool
) -> None:
    fresh = RunningMean(weighting)
    slot = torch.full((4, 3), float("nan"))  # old content must never be read
    stored = RunningMean(weighting, storage={"w": slot})
    shapes = {"w": (4, 3), "n": (2,)}
    for contribution in contributions():
        fresh.add(contribution)
        if by_pieces:
            stored.add_pieces(shapes, pieces_of(contribution), contribution.tokens)
        else:
            stored.add(contribution)
    assert stored.sums["w"].data_ptr() == slot.data_ptr()  # the sum lives in the storage
    assert_identical(stored.sums, fresh.sums)
    assert stored.totals == fresh.totals
    mean = stored.mean()
    assert mean["w"].data_ptr() == slot.data_ptr()
    assert_identical(mean, fresh.mean())


def test_storage_does_not_take_ownership_of_a_contribution() -> None:
    slot = torch.empty(3)
    running = RunningMean(storage={"w": slot})
    sent = torch.tensor([1.0, 2.0, 3.0])
    running.add(Contribution({"w": sent}), take_ownership=True)
    running.add(Contribution({"w": torch.ones(3)}))
    assert sent.tolist() == [1.0, 2.0, 3.0]  # the sender's tensor was copied, not summed into
    assert running.sums["w"].data_ptr() == slot.data_ptr()


def test_storage_of_another_shape_is_not_used() -> None:
    slot = torch.full((5,), 7.0)
    running = RunningMean(storage={"w": slot})
    running.add_pieces({"w": (3,)}, [("w", 0, torch.ones(3))], tokens=1)
    assert running.sums["w"].data_ptr() != slot.data_ptr()
    assert running.sums["w"].tolist() == [1.0] * 3 and slot.tolist() == [7.0] * 5


@pytest.mark.parametrize(
    "slot",
    [torch.zeros(3, dtype=torch.float64), torch.zeros(6)[::2], torch.zeros(3, dtype=torch.int32)],
    ids=["float64", "strided", "int32"],
)
def test_storage_must_be_contiguous_fp32(slot: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"'w'.*contiguous fp32"):
        RunningMean(storage={"w": slot})


def test_pieces_that_do_not_cover_a_stored_sum_are_an_error() -> None:
    running = RunningMean(storage={"w": torch.empty(4)})
    with pytest.raises(RuntimeError, match="did not cover"):
        running.add_pieces({"w": (4,)}, [("w", 0, torch.ones(2))], tokens=1)


def test_a_first_contribution_whose_pieces_fail_half_way_changes_nothing() -> None:
    slot = torch.full((6,), 5.0)
    running = RunningMean(storage={"w": slot})

    def failing():
        yield "w", 0, torch.ones(3)
        yield "n", 0, torch.ones(2)
        raise ValueError("NaN in the last piece")

    with pytest.raises(ValueError, match="last piece"):
        running.add_pieces({"w": (6,), "n": (2,)}, failing(), tokens=1, max_abs=lambda: 1.0)
    assert running.sums == {} and running.totals == {} and running.count == 0
    assert running.bound == 0.0
    pieces = [("w", 0, torch.full((6,), 2.0)), ("n", 0, torch.ones(2))]
    assert running.add_pieces({"w": (6,), "n": (2,)}, pieces, tokens=1, max_abs=lambda: 2.0)
    assert running.sums["w"].tolist() == [2.0] * 6 and running.bound == 2.0
