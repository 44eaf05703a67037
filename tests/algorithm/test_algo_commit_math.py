"""The server's commit math: finite_bound, RunningMean.bound, and apply_running_mean.

apply_running_mean must give exactly what apply_mean(running.mean()) gives (it only saves passes
over memory), refuse a non-finite mean before writing anything unless the bound proves the sums
finite, and a bound must never be below the largest magnitude it bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from diloco.algorithm import (
    Contribution,
    OuterOptimizer,
    RunningMean,
    TensorKind,
    apply_mean,
    apply_running_mean,
)
from diloco.algorithm.tensors import SparsePiece, finite_bound

KINDS = {
    "w": TensorKind.TRAINABLE,
    "b": TensorKind.TRAINABLE,
    "frozen": TensorKind.FROZEN,
    "norm": TensorKind.FLOAT_BUFFER,
    "count": TensorKind.INT_BUFFER,
    "mask": TensorKind.BOOL_BUFFER,
}


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 5, generator=generator),
        "b": torch.randn(5, generator=generator),
        "frozen": torch.randn(3, generator=generator),
        "norm": torch.randn(2, generator=generator),
        "count": torch.tensor([10, 20, 31], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def contributions(seed: int = 1) -> list[Contribution]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {n: t.shape for n, t in masters().items()}
    return [
        Contribution({n: torch.randn(s, generator=generator) for n, s in shapes.items()}, tokens)
        for tokens in (3, 1, 7)
    ]


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def assert_identical(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        assert torch.equal(left[name], right[name]), name


def running_of(
    items: list[Contribution], weighting: str, bounded: bool, storage: bool = False
) -> RunningMean:
    slots = {n: torch.empty(t.shape) for n, t in items[0].pseudo_gradient.items()}
    running = RunningMean(weighting, storage=slots if storage else None)
    for contribution in items:
        bound = max(finite_bound(t) for t in contribution.pseudo_gradient.values())
        running.add(contribution, max_abs=bound if bounded else math.inf)
    return running


@pytest.mark.parametrize(("kind", "momentum"), [("nesterov", 0.9), ("momentum", 0.8), ("sgd", 0)])
@pytest.mark.parametrize("policy", ["default", "all_floating"])
@pytest.mark.parametrize("weighting", ["uniform", "tokens"])
@pytest.mark.parametrize("bounded", [True, False])
def test_apply_running_mean_is_bit_identical_to_apply_mean(
    kind: str, momentum: float, policy: str, weighting: str, bounded: bool
) -> None:
    reference, fast = masters(), masters()
    reference_optimizer = OuterOptimizer(kind, lr=0.7, momentum=momentum)
    fast_optimizer = OuterOptimizer(kind, lr=0.7, momentum=momentum)
    for seed in (1, 2, 3):  # the first round creates the momentum, the others use it
        items = contributions(seed)
        mean = running_of(items, weighting, bounded).mean()
        apply_mean(reference, mean, reference_optimizer, KINDS, policy=policy)
        running = running_of(items, weighting, bounded, storage=True)
        assert running.certainly_finite is bounded
        updated = apply_running_mean(fast, running, fast_optimizer, KINDS, policy=policy)
        assert updated == list(KINDS)
        assert_identical(fast, reference)
        assert_identical(fast_optimizer.state_dict(), reference_optimizer.state_dict())
        with pytest.raises(RuntimeError, match="consumed"):
            running.consume()


def test_senders_make_each_element_a_mean_over_those_that_sent_it() -> None:
    """Three contributions, by hand: w element 0 sent by the first two (3 + 6) / 2 = 4.5,
    element 1 by nobody 0, element 2 by the third alone -4. "b" (not among the names divided:
    a buffer) keeps the plain mean, (1 + 0 + 3) / 3, though only two sent a value. The third
    arrives in pieces, as a spooled or compressed body does."""
    # the counts of "w" go to a preallocated tensor (its old values never read), as a
    # server's do every round; "b"'s, of another shape than its slot, to new memory
    kept = {"w": torch.full((3,), 7.0), "b": torch.full((2,), 7.0)}
    running = RunningMean("uniform", count_senders=True, senders_storage=kept)
    running.add(Contribution({"w": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([1.0])}, 1))
    running.add(Contribution({"w": torch.tensor([6.0, 0.0, 0.0]), "b": torch.tensor([0.0])}, 1))
    pieces = [("w", 0, torch.tensor([0.0, 0.0])), ("w", 2, torch.tensor([-4.0])),
              ("b", 0, torch.tensor([3.0]))]  # fmt: skip
    running.add_pieces({"w": (3,), "b": (1,)}, pieces, tokens=1)
    assert running.senders is not None and running.senders["w"].tolist() == [2.0, 0.0, 1.0]
    assert running.senders["w"] is kept["w"] and kept["b"].tolist() == [7.0, 7.0]
    running.divide_by_senders(["w"])
    assert running.senders is None and running.totals == {"w": 1.0, "b": 3.0}
    mean = running.mean()
    assert mean["w"].tolist() == [4.5, 0.0, -4.0]
    assert mean["b"].tolist() == pytest.approx([4.0 / 3.0])
    with pytest.raises(RuntimeError, match="does not count senders"):
        RunningMean().divide_by_senders(["w"])


def test_sparse_pieces_fold_their_kept_values_as_the_dense_pieces_would() -> None:
    """Top-k spans folded as kept values (SparsePiece), by hand. w (5 elements, its sum and
    count in preallocated storage full of 7s, never read): the first contribution keeps 2.0
    at 1 and -3.0 at 4, the second 0.5 at 1 and 8.0 at 3 (in two pieces: [0, 3) and [3, 5)),
    so the sums are [0, 2.5, 0, 8, -3] and the counts of senders [0, 2, 0, 1, 1]; a kept
    value of 0 is no sender. The same pieces made dense fold to the same bits."""

    def sparse(numel: int, positions: list[int], values: list[float]) -> SparsePiece:
        return SparsePiece(numel, torch.tensor(positions), torch.tensor(values))

    def folded(dense: bool) -> RunningMean:
        storage = {"w": torch.full((5,), 7.0)}
        senders = {"w": torch.full((5,), 7.0)}
        running = RunningMean(
            "uniform", storage=storage, count_senders=True, senders_storage=senders
        )
        assert running.takes_sparse(tokens=1)
        bodies = [
            [("w", 0, sparse(5, [1, 4], [2.0, -3.0]))],
            [("w", 0, sparse(3, [1, 2], [0.5, 0.0])), ("w", 3, sparse(2, [0], [8.0]))],
        ]
        for body in bodies:
            pieces = [(n, f, p.dense() if dense else p) for n, f, p in body]
            assert running.add_pieces({"w": (5,)}, pieces, tokens=1)
        assert running.sums["w"] is storage["w"] and running.senders is not None
        assert running.senders["w"] is senders["w"]
        return running

    running, reference = folded(dense=False), folded(dense=True)
    assert running.sums["w"].tolist() == [0.0, 2.5, 0.0, 8.0, -3.0]
    assert running.senders is not None and running.senders["w"].tolist() == [0, 2, 0, 1, 1]
    assert running.count == 2 and running.totals == {"w": 2.0}
    assert reference.senders is not None
    assert torch.equal(running.sums["w"].view(torch.int32), reference.sums["w"].view(torch.int32))
    assert torch.equal(running.senders["w"], reference.senders["w"])


def test_a_sparse_first_body_that_fails_part_way_leaves_the_round_as_it_was() -> None:
    """The round's first body, top-k spans into storage full of 7s: its first span is folded,
    then its reader raises (a bad index found in its second span). Nothing is registered: no
    sum, no count of senders, no contribution; the next body is then the round's first, and
    the sums are its own kept values by hand, [0, 0, 1.5, 0, -2], not 7s or the failed
    body's 4.0 at 0."""
    storage, counts = {"w": torch.full((5,), 7.0)}, {"w": torch.full((5,), 7.0)}
    running = RunningMean("uniform", storage=storage, count_senders=True, senders_storage=counts)

    def failing():
        yield "w", 0, SparsePiece(3, torch.tensor([0]), torch.tensor([4.0]))
        raise ValueError("tensor 'w': index 9 of chunk 1 is out of range")

    with pytest.raises(ValueError, match="index 9"):
        running.add_pieces({"w": (5,)}, failing(), tokens=1)
    assert running.count == 0 and running.sums == {} and running.totals == {}
    assert running.senders == {}
    good = [
        ("w", 0, SparsePiece(3, torch.tensor([2]), torch.tensor([1.5]))),
        ("w", 3, SparsePiece(2, torch.tensor([1]), torch.tensor([-2.0]))),
    ]
    assert running.add_pieces({"w": (5,)}, good, tokens=1)
    assert running.sums["w"].tolist() == [0.0, 0.0, 1.5, 0.0, -2.0]
    assert running.senders is not None and running.senders["w"].tolist() == [0, 0, 1, 0, 1]
    assert running.count == 1 and running.totals == {"w": 1.0}


def test_a_sparse_fold_keeps_a_sum_s_negative_zero_the_dense_fold_makes_positive() -> None:
    """The one difference `add_pieces` documents: the first body sends -0.0 at element 1 (a
    dense body); the second, top-k, keeps only element 0. The sparse fold leaves element 1's
    sum -0.0 (nothing is added there); the dense fold adds its 0.0, and -0.0 + 0.0 = +0.0 in
    IEEE 754. Every other bit is the same."""

    def folded(dense: bool) -> torch.Tensor:
        running = RunningMean("uniform")
        assert running.add_pieces({"w": (2,)}, [("w", 0, torch.tensor([1.0, -0.0]))], tokens=1)
        piece = SparsePiece(2, torch.tensor([0]), torch.tensor([2.0]))
        running.add_pieces({"w": (2,)}, [("w", 0, piece.dense() if dense else piece)], tokens=1)
        return running.sums["w"]

    sparse, dense = folded(dense=False), folded(dense=True)
    assert sparse.tolist() == dense.tolist() == [3.0, 0.0]
    assert math.copysign(1.0, sparse[1].item()) == -1.0
    assert math.copysign(1.0, dense[1].item()) == 1.0


def test_sparse_pieces_weighted_other_than_1_are_folded_dense() -> None:
    """Under tokens weighting a contribution's values are scaled (x 3 here), which only the
    dense fold rounds as it always did: the sparse piece is made dense first. By hand:
    3 x [0, 1.5, 0] + 1 x [0.25, 0, 0] = [0.25, 4.5, 0]."""
    running = RunningMean("tokens")
    assert not running.takes_sparse(tokens=3) and running.takes_sparse(tokens=1)
    piece = SparsePiece(3, torch.tensor([1]), torch.tensor([1.5]))
    assert running.add_pieces({"w": (3,)}, [("w", 0, piece)], tokens=3)
    piece = SparsePiece(3, torch.tensor([0]), torch.tensor([0.25]))
    assert running.add_pieces({"w": (3,)}, [("w", 0, piece)], tokens=1)
    assert running.sums["w"].tolist() == [0.25, 4.5, 0.0] and running.totals == {"w": 4.0}


def test_a_non_finite_sum_is_refused_before_anything_changes() -> None:
    weights = masters()
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    apply_running_mean(weights, running_of(contributions(), "uniform", True), optimizer, KINDS)
    before, momentum = clone(weights), optimizer.state_dict()
    huge = contributions()
    for contribution in huge:  # finite values whose sum overflows fp32
        contribution.pseudo_gradient["b"].fill_(3e38)
    running = running_of(huge, "uniform", bounded=True)
    assert running.sums["b"].isinf().all() and not running.certainly_finite
    with pytest.raises(ValueError, match="'b' has NaN or Inf"):
        apply_running_mean(weights, running, optimizer, KINDS)
    assert_identical(weights, before)
    assert_identical(optimizer.state_dict(), momentum)


def test_an_empty_running_mean_changes_nothing() -> None:
    weights = masters()
    assert apply_running_mean(weights, RunningMean(), OuterOptimizer("sgd", lr=1.0), KINDS) == []
    assert_identical(weights, masters())


def test_a_bound_is_only_as_good_as_every_contribution_s() -> None:
    running = RunningMean("tokens")
    running.add(Contribution({"w": torch.ones(3)}, tokens=4), max_abs=2.0)
    assert running.bound == 8.0 and running.certainly_finite
    running.add_pieces({"w": (3,)}, [("w", 0, torch.ones(3))], tokens=1)  # no bound given
    assert running.bound == math.inf and not running.certainly_finite
    big = RunningMean()
    big.add(Contribution({"w": torch.ones(3)}), max_abs=1e37)
    big.add(Contribution({"w": torch.ones(3)}), max_abs=1e37)
    assert not big.certainly_finite  # 2e37 is past the limit kept for rounding


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000) * 5,
        torch.randn(7, 9).to(torch.bfloat16),
        torch.randn(5, dtype=torch.float64) * 1e200,
        torch.tensor([0.0, -3.5, 2.0]),
        torch.tensor(-7.25),
        torch.tensor([2**40, -(2**62), 5], dtype=torch.int64),
        torch.tensor([True, False]),
        torch.zeros(0, 3),
    ],
    ids=["fp32", "bf16", "fp64-huge", "small", "scalar", "int64", "bool", "empty"],
)
def test_finite_bound_is_at_least_the_largest_magnitude(tensor: torch.Tensor) -> None:
    bound = finite_bound(tensor)
    assert bound is not None
    largest = float(tensor.abs().max()) if tensor.numel() and tensor.dtype != torch.bool else 0
    assert bound >= largest


def test_finite_bound_finds_nan_and_inf_and_bounds_huge_values_exactly() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.zeros(10_000)
        tensor[4321] = bad
        assert finite_bound(tensor) is None
        assert finite_bound(tensor.to(torch.bfloat16)) is None
    huge = torch.tensor([1e30, -3e38, 2.0, 0.0])  # finite, but its squares overflow fp32
    assert finite_bound(huge) == pytest.approx(3e38, rel=1e-6)  # the largest magnitude


@pytest.mark.parametrize("strided", [False, True], ids=["fused", "strided"])
def test_divisors_divide_the_grads_in_the_step_as_a_division_first_would(strided: bool) -> None:
    generator = torch.Generator().manual_seed(9)
    start = torch.randn(50, generator=generator)
    sums = [torch.randn(50, generator=generator) * 3 for _ in range(3)]
    divided, stepped = {"w": start.clone()}, {"w": start.clone()}
    first = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    second = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    for total in sums:
        first.step(divided, {"w": total / 3.0})
        holder = torch.zeros(100)
        if strided:  # every other element of a larger tensor: the separate passes
            holder[::2] = total
            grad = holder[::2]
        else:
            grad = total.clone()
        second.step(stepped, {"w": grad}, divisors={"w": 3.0})
        assert torch.equal(grad, total / 3.0)  # divided in place, as documented
        assert not holder[1::2].any()
    if strided:  # the separate passes round differently from the fused kernel
        torch.testing.assert_close(stepped["w"], divided["w"], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(stepped["w"], divided["w"])


def test_a_strided_momentum_buffer_still_gets_the_divided_gradient() -> None:
    """param and grad contiguous, the momentum buffer (restored from a transposed tensor)
    strided: the step takes the separate passes and must still divide the sum first."""
    generator = torch.Generator().manual_seed(4)
    start = torch.randn(4, 3, generator=generator)
    momentum = {"w": torch.randn(3, 4, generator=generator).t()}  # strided, as loaded
    total = torch.randn(4, 3, generator=generator) * 4
    first = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    second = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    first.load_state_dict(momentum)
    second.load_state_dict(momentum)
    divided, stepped = {"w": start.clone()}, {"w": start.clone()}
    first.step(divided, {"w": total / 4.0})
    second.step(stepped, {"w": total.clone()}, divisors={"w": 4.0})
    torch.testing.assert_close(stepped["w"], divided["w"], rtol=1e-6, atol=1e-6)


def test_a_grad_of_another_dtype_is_divided_in_its_copy_and_nothing_half_applies() -> None:
    """An fp64 sum for an fp32 parameter is copied to fp32 and divided there; the caller's
    tensor is not written, and no earlier name is left stepped by a later refusal."""
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    optimizer = OuterOptimizer("sgd", lr=1.0)
    grad_b = torch.full((3,), 4.0, dtype=torch.float64)
    optimizer.step(params, {"a": torch.full((3,), 4.0), "b": grad_b}, divisors={"a": 2, "b": 2})
    assert params["a"].tolist() == [-1.0] * 3 and params["b"].tolist() == [-1.0] * 3
    assert grad_b.tolist() == [4.0] * 3


def test_a_non_finite_buffer_mean_is_refused_before_anything_changes() -> None:
    """A float buffer does not go through the optimizer, yet its overflowing sum must be
    refused like a parameter's, before any weight or momentum moves."""
    weights = masters()
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    apply_running_mean(weights, running_of(contributions(), "uniform", True), optimizer, KINDS)
    before, momentum = clone(weights), optimizer.state_dict()
    huge = contributions()
    for contribution in huge:
        contribution.pseudo_gradient["norm"].fill_(3e38)
    running = running_of(huge, "uniform", bounded=True)
    assert not running.certainly_finite
    with pytest.raises(ValueError, match="'norm' has NaN or Inf"):
        apply_running_mean(weights, running, optimizer, KINDS)
    assert_identical(weights, before)
    assert_identical(optimizer.state_dict(), momentum)


def test_scale_multiplies_the_values_but_not_the_weight() -> None:
    """Async staleness scaling: a stale pseudo-gradient counts once, made smaller."""
    for fold in ("add", "add_pieces"):
        running = RunningMean("tokens")
        value = torch.full((4,), 2.0)
        if fold == "add":
            running.add(Contribution({"w": value}, tokens=3), scale=0.5)
        else:
            running.add_pieces({"w": (4,)}, [("w", 0, value)], tokens=3, scale=0.5)
        assert running.sums["w"].tolist() == [3.0] * 4, fold  # 3 * 0.5 * 2
        assert running.totals["w"] == 3.0, fold
        assert running.mean()["w"].tolist() == [1.0] * 4, fold


def test_pieces_that_miss_part_of_a_new_sum_leave_the_mean_as_it_was() -> None:
    running = RunningMean()
    with pytest.raises(RuntimeError, match="did not cover it once"):
        running.add_pieces({"w": (4,)}, [("w", 0, torch.ones(2))], tokens=1)
    assert (running.sums, running.totals, running.count) == ({}, {}, 0)


def test_mean_uses_the_running_mean_up() -> None:
    running = RunningMean()
    running.add(Contribution({"w": torch.full((2,), 4.0)}))
    assert running.mean()["w"].tolist() == [4.0, 4.0]
    with pytest.raises(RuntimeError, match="consumed"):
        running.mean()  # a second call would divide the sums again
