"""Workers' pseudo-gradients for one round, and their (weighted) mean.

A worker may send a subset of names (one streaming fragment), so the mean is taken per name over
the contributions that carry it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.algorithm._checks import require_choice
from diloco.algorithm.tensors import SparsePiece, TensorDict, all_finite

WEIGHTINGS = ("uniform", "tokens")
FINITE_SUM_LIMIT = 1e37


@dataclass(frozen=True)
class Contribution:
    """One worker's pseudo-gradient (anchor - local) and how many tokens it trained on."""

    pseudo_gradient: Mapping[str, torch.Tensor]
    tokens: int = 1
    worker: str = ""


def check_weighting(weighting: str) -> str:
    """Raise ValueError naming the allowed values if `weighting` is unknown."""
    return require_choice("weighting", weighting, WEIGHTINGS)


def contribution_weight(contribution: Contribution, weighting: str) -> float:
    """Weight in the mean; 0 means "left out" (a non-positive token count under "tokens")."""
    if weighting == "uniform":
        return 1.0
    return float(contribution.tokens) if contribution.tokens > 0 else 0.0


def is_finite_contribution(contribution: Contribution) -> bool:
    """True when no tensor of the contribution holds NaN or Inf."""
    return all(all_finite(tensor) for tensor in contribution.pseudo_gradient.values())


def _write_scaled(target: torch.Tensor, value: torch.Tensor, weight: float) -> None:
    """target = weight * value, without a temporary."""
    if weight == 1.0:
        target.copy_(value)
    else:
        torch.mul(value, weight, out=target)


class RunningMean:
    """Per-name weighted sum of pseudo-gradients, folded in one contribution at a time.

    A server keeps one of these per round instead of every worker's tensors, so its memory does
    not grow with the number of workers (one fp32 copy of the model, whatever K is).
    """

    def __init__(
        self,
        weighting: str = "uniform",
        storage: Mapping[str, torch.Tensor] | None = None,
        count_senders: bool = False,
        senders_storage: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """`storage`: preallocated contiguous fp32 CPU tensors, by name, for the sums to live in.

        Their old values are never read: a name's first contribution is written over them. A
        server passes the same buffers every round, so a round neither allocates (and
        page-faults) a model-sized sum nor zeroes one.

        `count_senders`: also sum, per element, the weights of the contributions whose value
        there is not 0, so that `divide_by_senders` can make each element's mean over the
        workers that sent it (`--aggregation sparse_mean`: SparseLoCo's mean of top-k
        uploads); one more fp32 model of memory, the tensors of `senders_storage` (zeroed as
        each name is first counted) where they have the name's shape, as for `storage`.
        """
        self.weighting = check_weighting(weighting)
        self.senders: TensorDict | None = {} if count_senders else None
        self.sums: TensorDict = {}
        self.totals: dict[str, float] = {}
        self.count = 0
        # An upper bound of every |sum| (sum of weight * the largest |value| of each folded
        # contribution), when every contribution came with one; inf otherwise.
        self.bound = 0.0
        self._consumed = False
        self._storage = dict(storage or {})
        self._senders_storage = dict(senders_storage or {})
        for name, slot in self._storage.items():
            if slot.dtype != torch.float32 or slot.device.type != "cpu" or not slot.is_contiguous():
                raise ValueError(f"storage for {name!r} must be a contiguous fp32 CPU tensor")

    @classmethod
    def restored(
        cls,
        weighting: str,
        sums: Mapping[str, torch.Tensor],
        totals: Mapping[str, float],
        count: int,
        bound: float,
    ) -> RunningMean:
        """A running mean as it stood when its step was logged (a server's step log, replayed
        after a crash): the same sums, totals, count and bound, so the step comes out the
        same, bit for bit."""
        running = cls(weighting)
        running.sums = dict(sums)
        running.totals = {name: float(totals[name]) for name in sums}
        running.count = int(count)
        running.bound = float(bound)
        return running

    def _slot(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The preallocated tensor for `name`'s sum, if there is one of this shape."""
        slot = self._storage.get(name)
        return slot if slot is not None and tuple(slot.shape) == tuple(shape) else None

    def add(
        self,
        contribution: Contribution,
        *,
        take_ownership: bool = False,
        scale: float = 1.0,
        max_abs: float = math.inf,
    ) -> bool:
        """Fold `contribution` in; False (and nothing changes) when its weight is zero.

        With `take_ownership` the caller hands its fp32 CPU tensors over (a server's private
        request buffer): the first contribution then becomes the sums without a copy, and later
        ones are added into it in place. Without it, inputs are never written. `scale`
        multiplies the values but not the weight (async staleness scaling: a stale
        pseudo-gradient counts as one contribution, made smaller). `max_abs`: an upper bound
        of its values' magnitude, when the caller knows one (see `bound`).
        """
        if self._consumed:
            raise RuntimeError("this RunningMean was consumed by mean(); start a new one")
        weight = contribution_weight(contribution, self.weighting)
        if weight <= 0:
            return False
        factor = weight * scale
        for name, tensor in contribution.pseudo_gradient.items():
            total = self.sums.get(name)
            if total is not None and total.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)} in one contribution "
                    f"and {tuple(total.shape)} in another"
                )
        for name, tensor in contribution.pseudo_gradient.items():
            value = tensor.detach().to(device="cpu", dtype=torch.float32)
            if self.senders is not None:
                if name not in self.senders:
                    self.senders[name] = self._zeroed_count(name, tuple(value.shape))
                self.senders[name].add_(value.ne(0).to(torch.float32), alpha=weight)
            total = self.sums.get(name)
            slot = None if total is not None else self._slot(name, tuple(tensor.shape))
            if slot is not None:
                _write_scaled(slot, value, factor)
                self.sums[name] = slot
                self.totals[name] = weight
            elif total is None:
                owned = take_ownership and value.data_ptr() == tensor.data_ptr()
                if owned and value.is_contiguous():
                    self.sums[name] = value if factor == 1.0 else value.mul_(factor)
                else:
                    self.sums[name] = value * factor
                self.totals[name] = weight
            else:
                total.add_(value, alpha=factor)
                self.totals[name] += weight
        self.count += 1
        self.bound += abs(factor) * max_abs
        return True

    def takes_sparse(self, tokens: int, scale: float = 1.0) -> bool:
        """Whether `add_pieces` folds a contribution with `tokens` and `scale` from sparse
        pieces as it would from their dense form: when its values are added unscaled (x 1 is
        exact, so adding only the kept values rounds each sum exactly as adding the whole
        span does). Otherwise a sparse piece is made dense first."""
        factor = contribution_weight(Contribution({}, tokens), self.weighting) * scale
        return factor == 1.0

    def add_pieces(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        pieces: Iterable[tuple[str, int, torch.Tensor | SparsePiece]],
        tokens: int,
        *,
        scale: float = 1.0,
        max_abs: float | Callable[[], float] = math.inf,
    ) -> bool:
        """Fold a contribution that arrives as (name, first element, 1-D piece) slices.

        For a body read back from disk a piece at a time: memory stays one piece, whatever the
        model size. `shapes` names every tensor the pieces cover; they are checked against the
        running sums before anything is folded. The pieces must cover each tensor exactly once.
        `max_abs` may be a function, asked once the pieces are read (a reader that checks the
        values on the way finds the bound then).

        A piece may be a `SparsePiece` (a top-k span): where `takes_sparse`, only its kept
        values are added (and counted as senders), each sum rounding as in the dense fold; a
        sum that stays 0 may keep the sign of zero it had, where the dense fold's + 0 would
        make it +0 (it can differ only for a master weight that is exactly -0).

        When no name has a sum yet (the round's first contribution), pieces that raise part
        way (a checking reader finding NaN) leave this object exactly as it was; otherwise the
        sums would be left half folded, so check first.
        """
        if self._consumed:
            raise RuntimeError("this RunningMean was consumed by mean(); start a new one")
        weight = contribution_weight(Contribution({}, tokens), self.weighting)
        if weight <= 0:
            return False
        factor = weight * scale
        for name, shape in shapes.items():
            total = self.sums.get(name)
            if total is not None and tuple(total.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(shape)} in one contribution "
                    f"and {tuple(total.shape)} in another"
                )
        # Names without a sum yet: this contribution writes theirs first (over a preallocated
        # slot, or new memory); they are registered only once every piece is folded.
        new_sums: TensorDict = {}
        for name, shape in shapes.items():
            if name not in self.sums:
                slot = self._slot(name, tuple(shape))
                new_sums[name] = torch.empty(shape, dtype=torch.float32) if slot is None else slot
        fresh = dict.fromkeys(new_sums, 0)  # elements written so far
        senders: TensorDict = {}  # (counting them) registered with the sums, at the end
        if self.senders is not None:
            senders = {
                name: self.senders[name]
                if name in self.senders
                else self._zeroed_count(name, tuple(shape))
                for name, shape in shapes.items()
            }
        scratch = torch.empty(0, dtype=torch.float32)  # a sparse piece made dense
        for name, first, piece in pieces:
            if isinstance(piece, SparsePiece) and factor != 1.0:
                if scratch.numel() < piece.length:
                    scratch = torch.empty(piece.length, dtype=torch.float32)
                piece = piece.dense(scratch[: piece.length])
            numel = piece.numel()
            if name in senders:
                span = senders[name].view(-1)[first : first + numel]
                if isinstance(piece, SparsePiece):  # + weight where a value is not 0
                    sent = piece.values.ne(0).to(torch.float32)
                    span.index_add_(0, piece.positions, sent, alpha=weight)
                else:
                    span.add_(piece.ne(0).to(torch.float32), alpha=weight)
            target = self.sums.get(name)
            part = (new_sums[name] if target is None else target).view(-1)
            part = part[first : first + numel]
            if isinstance(piece, SparsePiece):  # factor 1: the kept values, unscaled
                if name in fresh:
                    piece.dense(part)
                    fresh[name] += numel
                else:
                    part.index_add_(0, piece.positions, piece.values)
                continue
            if name not in fresh:
                part.add_(piece, alpha=factor)
                continue
            _write_scaled(part, piece, factor)
            fresh[name] += numel
        for name, written in fresh.items():
            if written != new_sums[name].numel():
                raise RuntimeError(f"the pieces of {name!r} did not cover it once, in full")
        self.sums.update(new_sums)
        if self.senders is not None:
            self.senders.update(senders)
        for name in shapes:
            self.totals[name] = self.totals.get(name, 0.0) + weight
        self.count += 1
        self.bound += abs(factor) * (max_abs() if callable(max_abs) else max_abs)
        return True

    def headroom(self, tokens: int, scale: float = 1.0) -> float | None:
        """The largest magnitude a contribution with `tokens` and `scale` may hold so that,
        weighted and added, every sum stays provably finite (`certainly_finite`); None when
        that cannot be known (a bound is unknown already, or the contribution weighs 0)."""
        weight = contribution_weight(Contribution({}, tokens), self.weighting)
        factor = abs(weight * scale)
        if factor == 0 or not math.isfinite(self.bound):
            return None
        return (FINITE_SUM_LIMIT - self.bound) / factor

    @property
    def certainly_finite(self) -> bool:
        """True when `bound` proves every sum, and so every mean, finite in fp32.

        The limit leaves a factor of 30 below fp32's largest value for the sums' rounding, and
        a mean divides a sum by a total weight of at least 1.
        """
        return self.bound <= FINITE_SUM_LIMIT

    def _zeroed_count(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeros for `name`'s count of senders: its preallocated tensor when it has one."""
        slot = self._senders_storage.get(name)
        if slot is not None and tuple(slot.shape) == shape:
            return slot.zero_()
        return torch.zeros(shape)

    def divide_by_senders(self, names: Iterable[str]) -> None:
        """Make the sums of `names` (the trained tensors: buffers keep the plain mean, as in
        robust.aggregate) their elements' means over the contributions that sent them (0
        where none did), in place, with totals 1, so that the step's division changes
        nothing there; the sender counts go. Before the server logs its step (the log then
        holds the means, and a replay divides by 1 again)."""
        if self.senders is None:
            raise RuntimeError("this RunningMean does not count senders")
        tiny = torch.finfo(torch.float32).tiny  # where nobody sent, the sum is 0: 0 / tiny
        for name in names:
            if name in self.sums:
                self.sums[name].div_(self.senders[name].clamp_(min=tiny))
                self.totals[name] = 1.0
        self.senders = None

    def consume(self) -> tuple[TensorDict, dict[str, float]]:
        """The sums and total weights, not yet divided; uses this object up, as `mean()` does."""
        if self._consumed:
            raise RuntimeError("this RunningMean was consumed already; start a new one")
        self._consumed = True
        return self.sums, self.totals

    def mean(self) -> TensorDict:
        """The per-name mean, computed in place over the sums (so this object is used up).

        A name no weighted contribution carried is absent.
        """
        sums, totals = self.consume()
        return {name: total.div_(totals[name]) for name, total in sums.items()}


def average_contributions(
    contributions: Sequence[Contribution], weighting: str = "uniform"
) -> TensorDict:
    """Per-name weighted mean of the pseudo-gradients, float32 on CPU.

    "uniform" weighs every contribution 1; "tokens" weighs by token count and leaves out
    contributions with tokens <= 0. A name no weighted contribution carries is absent.
    """
    running = RunningMean(weighting)
    for contribution in contributions:
        running.add(contribution)
    return running.mean()
