"""Workers' pseudo-gradients for one round, and their (weighted) mean.

A worker may send a subset of names (one streaming fragment), so the mean is taken per name over
the contributions that carry it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.algorithm._checks import require_choice
from diloco.algorithm.tensors import TensorDict, all_finite

WEIGHTINGS = ("uniform", "tokens")


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


class RunningMean:
    """Per-name weighted sum of pseudo-gradients, folded in one contribution at a time.

    A server keeps one of these per round instead of every worker's tensors, so its memory does
    not grow with the number of workers (one fp32 copy of the model, whatever K is).
    """

    def __init__(self, weighting: str = "uniform") -> None:
        self.weighting = check_weighting(weighting)
        self.sums: TensorDict = {}
        self.totals: dict[str, float] = {}
        self.count = 0
        self._consumed = False

    def add(self, contribution: Contribution, *, take_ownership: bool = False) -> bool:
        """Fold `contribution` in; False (and nothing changes) when its weight is zero.

        With `take_ownership` the caller hands its fp32 CPU tensors over (a server's private
        request buffer): the first contribution then becomes the sums without a copy, and later
        ones are added into it in place. Without it, inputs are never written.
        """
        if self._consumed:
            raise RuntimeError("this RunningMean was consumed by mean(); start a new one")
        weight = contribution_weight(contribution, self.weighting)
        if weight <= 0:
            return False
        for name, tensor in contribution.pseudo_gradient.items():
            total = self.sums.get(name)
            if total is not None and total.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)} in one contribution "
                    f"and {tuple(total.shape)} in another"
                )
        for name, tensor in contribution.pseudo_gradient.items():
            value = tensor.detach().to(device="cpu", dtype=torch.float32)
            total = self.sums.get(name)
            if total is None:
                owned = take_ownership and value.data_ptr() == tensor.data_ptr()
                if owned and value.is_contiguous():
                    self.sums[name] = value if weight == 1.0 else value.mul_(weight)
                else:
                    self.sums[name] = value * weight
                self.totals[name] = weight
            else:
                total.add_(value, alpha=weight)
                self.totals[name] += weight
        self.count += 1
        return True

    def add_pieces(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        pieces: Iterable[tuple[str, int, torch.Tensor]],
        tokens: int,
    ) -> bool:
        """Fold a contribution that arrives as (name, first element, 1-D piece) slices.

        For a body read back from disk a piece at a time: memory stays one piece, whatever the
        model size. `shapes` names every tensor the pieces cover; they are checked against the
        running sums before anything is folded.
        """
        if self._consumed:
            raise RuntimeError("this RunningMean was consumed by mean(); start a new one")
        weight = contribution_weight(Contribution({}, tokens), self.weighting)
        if weight <= 0:
            return False
        for name, shape in shapes.items():
            total = self.sums.get(name)
            if total is not None and tuple(total.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(shape)} in one contribution "
                    f"and {tuple(total.shape)} in another"
                )
        for name, shape in shapes.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros(shape, dtype=torch.float32)
                self.totals[name] = 0.0
            self.totals[name] += weight
        for name, first, piece in pieces:
            flat = self.sums[name].view(-1)
            flat[first : first + piece.numel()].add_(piece, alpha=weight)
        self.count += 1
        return True

    def mean(self) -> TensorDict:
        """The per-name mean, computed in place over the sums (so this object is used up).

        A name no weighted contribution carried is absent.
        """
        self._consumed = True
        return {name: total.div_(self.totals[name]) for name, total in self.sums.items()}


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
