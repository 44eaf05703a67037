"""Workers' pseudo-gradients for one round, and their (weighted) mean.

A worker may send a subset of names (one streaming fragment), so the mean is taken per name over
the contributions that carry it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.algorithm._checks import require_choice
from diloco.algorithm.tensors import TensorDict

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
    return all(
        bool(torch.isfinite(tensor).all())
        for tensor in contribution.pseudo_gradient.values()
        if tensor.is_floating_point() or tensor.is_complex()
    )


def average_contributions(
    contributions: Sequence[Contribution], weighting: str = "uniform"
) -> TensorDict:
    """Per-name weighted mean of the pseudo-gradients, float32 on CPU.

    "uniform" weighs every contribution 1; "tokens" weighs by token count and leaves out
    contributions with tokens <= 0. A name no weighted contribution carries is absent.
    """
    check_weighting(weighting)
    sums: TensorDict = {}
    totals: dict[str, float] = {}
    for contribution in contributions:
        weight = contribution_weight(contribution, weighting)
        if weight <= 0:
            continue
        for name, tensor in contribution.pseudo_gradient.items():
            value = tensor.detach().to(device="cpu", dtype=torch.float32)
            total = sums.get(name)
            if total is None:
                sums[name] = value * weight
                totals[name] = weight
                continue
            if total.shape != value.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(value.shape)} in one contribution "
                    f"and {tuple(total.shape)} in another"
                )
            total.add_(value, alpha=weight)
            totals[name] += weight
    return {name: total.div_(totals[name]) for name, total in sums.items()}
