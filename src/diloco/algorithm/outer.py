"""One outer round: pseudo-gradients in, new global (master) weights out.

`outer_step` is the single function both the server and the simulator call for a round, so a
real multi-process run and the simulator apply exactly the same update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from diloco.algorithm._checks import require_choice
from diloco.algorithm.contributions import (
    WEIGHTINGS,
    Contribution,
    RunningMean,
    average_contributions,
    check_weighting,
    contribution_weight,
    is_finite_contribution,
)
from diloco.algorithm.fragments import alpha_merge
from diloco.algorithm.outer_optimizer import OUTER_KINDS, OuterOptimizer
from diloco.algorithm.tensors import TensorDict, TensorKind, all_finite

__all__ = [
    "APPLY_POLICIES",
    "OUTER_KINDS",
    "WEIGHTINGS",
    "Contribution",
    "OuterOptimizer",
    "OuterStepResult",
    "UpdateRule",
    "alpha_merge",
    "apply_mean",
    "apply_running_mean",
    "average_contributions",
    "is_finite_contribution",
    "outer_step",
    "pseudo_gradient",
]

APPLY_POLICIES = ("default", "all_floating")

# Bool buffers: True when the mean is >= 0.5; the slack absorbs float32 noise in weighted means.
_BOOL_THRESHOLD = 0.5 - 1e-6


class UpdateRule(Protocol):
    """What `outer_step` needs from an optimizer (OuterOptimizer, DelayedNesterov)."""

    def step(
        self,
        params: TensorDict,
        grads: Mapping[str, torch.Tensor],
        /,
        *,
        divisors: Mapping[str, float] | None = None,
        finite: bool = False,
    ) -> None: ...


def _difference(name: str, anchor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if tuple(anchor.shape) != tuple(local.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(anchor.shape)} in the anchor "
            f"and {tuple(local.shape)} locally"
        )
    anchor = anchor.detach()
    local = local.detach().to(anchor.device)
    wide = _difference_dtype(anchor, local)
    return anchor.to(wide) - local.to(wide)


def _difference_dtype(anchor: torch.Tensor, local: torch.Tensor) -> torch.dtype:
    """float32 when either is floating; else int64: integers and bools are subtracted exactly
    (and so travel exactly, whatever the float wire dtype: bf16 would turn 257 into 256)."""
    floating = anchor.is_floating_point() or local.is_floating_point()
    return torch.float32 if floating else torch.int64


def pseudo_gradient_into(
    anchor: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
) -> None:
    """`pseudo_gradient` written into `out` (per name a CPU tensor of its shape: float32 for
    floating tensors, int64 for the others), element for element the same values, with no
    model-sized temporary: a worker computes it straight into its upload body. An anchor on
    an accelerator subtracts there, one tensor at a time, and only the difference crosses."""
    _check_same_names(anchor, local)
    for name, target in out.items():
        ours, theirs = anchor[name].detach(), local[name].detach()
        if tuple(ours.shape) != tuple(theirs.shape) or tuple(target.shape) != tuple(ours.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(ours.shape)} in the anchor, "
                f"{tuple(theirs.shape)} locally and {tuple(target.shape)} in the output"
            )
        wide = _difference_dtype(ours, theirs)
        if target.dtype != wide:
            raise ValueError(f"tensor {name!r}: the output is {target.dtype}, expected {wide}")
        if ours.device == target.device:
            torch.sub(ours.to(wide), theirs.to(device=ours.device, dtype=wide), out=target)
        else:
            target.copy_(ours.to(wide) - theirs.to(device=ours.device, dtype=wide))


def _check_same_names(
    anchor: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
) -> None:
    missing = [name for name in anchor if name not in local]
    extra = [name for name in local if name not in anchor]
    if missing or extra:
        raise ValueError(
            f"anchor and local tensors differ: missing locally {missing}, not in anchor {extra}"
        )


def pseudo_gradient(
    anchor: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
) -> TensorDict:
    """anchor - local for every name, on the anchor's device: float32, or int64 for int and
    bool tensors.

    The sign makes outer SGD with lr 1 a plain average of the local models (FedAvg). Integer
    and bool tensors are subtracted exactly in int64 and stay int64, so that no float wire
    dtype can round them.
    """
    _check_same_names(anchor, local)
    return {name: _difference(name, anchor[name], local[name]) for name in anchor}


@dataclass
class OuterStepResult:
    """What a round did: how many contributions were used, which names changed, who was skipped."""

    contributors: int
    updated: list[str] = field(default_factory=list)
    skipped_workers: list[str] = field(default_factory=list)


def _uses_optimizer(kind: TensorKind, policy: str) -> bool:
    if kind is TensorKind.TRAINABLE:
        return True
    if kind in (TensorKind.FROZEN, TensorKind.FLOAT_BUFFER):
        return policy == "all_floating"
    return False


def _label(contribution: Contribution, index: int) -> str:
    return contribution.worker or f"#{index}"


def _check_contribution(
    contribution: Contribution,
    label: str,
    masters: Mapping[str, torch.Tensor],
    kinds: Mapping[str, TensorKind],
    policy: str,
) -> None:
    for name, tensor in contribution.pseudo_gradient.items():
        master = masters.get(name)
        if master is None:
            raise ValueError(f"contribution {label}: tensor {name!r} is not in the global model")
        if tuple(tensor.shape) != tuple(master.shape):
            raise ValueError(
                f"contribution {label}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the global model has {tuple(master.shape)}"
            )
        kind = kinds.get(name)
        if kind is None:
            raise ValueError(f"tensor {name!r} has no kind (see classify_tensors)")
        if _uses_optimizer(TensorKind(kind), policy) and not master.is_floating_point():
            raise ValueError(
                f"tensor {name!r} is {TensorKind(kind).value} but its master has dtype "
                f"{master.dtype}, not floating"
            )


def _assign_mean(master: torch.Tensor, mean_gradient: torch.Tensor, kind: TensorKind) -> None:
    """Set `master` to the mean local value, master - mean(anchor - local)."""
    if kind is TensorKind.INT_BUFFER or kind is TensorKind.BOOL_BUFFER:
        local_mean = master.to(torch.float64) - mean_gradient.to(torch.float64)
        if kind is TensorKind.BOOL_BUFFER:
            master.copy_(local_mean >= _BOOL_THRESHOLD)
        else:
            master.copy_(torch.round(local_mean))  # round half to even
        return
    master.sub_(mean_gradient.to(master.dtype))


def outer_step(
    masters: TensorDict,
    contributions: Sequence[Contribution],
    optimizer: UpdateRule,
    kinds: Mapping[str, TensorKind],
    *,
    weighting: str = "uniform",
    policy: str = "default",
) -> OuterStepResult:
    """Apply one round's contributions to `masters` in place.

    Contributions holding NaN/Inf are skipped (listed by worker, or "#index" when unnamed).
    Policy "default": trainable tensors get the optimizer; frozen parameters and float buffers
    become the mean local value; int buffers the mean rounded half to even; bool buffers True
    when the mean is >= 0.5. Policy "all_floating" sends every floating tensor through the
    optimizer. Names no used contribution carries keep their weights and momentum; a round with
    no used contribution changes nothing. Every contribution is checked before anything is
    written, so a ValueError leaves `masters` and the optimizer as they were.
    """
    require_choice("apply policy", policy, APPLY_POLICIES)
    check_weighting(weighting)
    labels = [_label(c, index) for index, c in enumerate(contributions)]
    for contribution, label in zip(contributions, labels, strict=True):
        _check_contribution(contribution, label, masters, kinds, policy)

    used: list[Contribution] = []
    skipped: list[str] = []
    for contribution, label in zip(contributions, labels, strict=True):
        if not is_finite_contribution(contribution):
            skipped.append(label)
        elif contribution_weight(contribution, weighting) > 0:
            used.append(contribution)

    mean = average_contributions(used, weighting)
    updated = apply_mean(masters, mean, optimizer, kinds, policy=policy)
    return OuterStepResult(contributors=len(used), updated=updated, skipped_workers=skipped)


def apply_mean(
    masters: TensorDict,
    mean: Mapping[str, torch.Tensor],
    optimizer: UpdateRule,
    kinds: Mapping[str, TensorKind],
    *,
    policy: str = "default",
) -> list[str]:
    """Apply a round's mean pseudo-gradient to `masters` in place; returns the updated names.

    The second half of `outer_step`, for callers that fold contributions in as they arrive
    (`RunningMean`). An empty mean changes nothing. Names, shapes and kinds are checked first.
    """
    require_choice("apply policy", policy, APPLY_POLICIES)
    return _apply_values(masters, dict(mean), optimizer, kinds, policy)


def apply_running_mean(
    masters: TensorDict,
    running: RunningMean,
    optimizer: UpdateRule,
    kinds: Mapping[str, TensorKind],
    *,
    policy: str = "default",
) -> list[str]:
    """`apply_mean(masters, running.mean(), ...)` with fewer passes over memory, same result.

    The server's commit. Each sum is divided by its total weight inside the optimizer's fused
    step instead of in a pass of its own, and the NaN/Inf scan is skipped when the running
    mean's bound proves every sum finite (each folded contribution was scanned, and came with
    the magnitude of its largest value). Uses up `running`, as `mean()` does: its sums end up
    holding the mean.
    """
    require_choice("apply policy", policy, APPLY_POLICIES)
    sums, totals = running.consume()
    return _apply_values(
        masters, sums, optimizer, kinds, policy, divisors=totals, finite=running.certainly_finite
    )


def _apply_values(
    masters: TensorDict,
    values: TensorDict,
    optimizer: UpdateRule,
    kinds: Mapping[str, TensorKind],
    policy: str,
    *,
    divisors: Mapping[str, float] | None = None,
    finite: bool = False,
) -> list[str]:
    """The update both apply functions make: values[name] / divisors[name] (the division in
    place, inside the optimizer's pass for its names) is the mean for each name."""
    if not values:
        return []
    _check_contribution(Contribution(values, worker="mean"), "mean", masters, kinds, policy)
    if not finite:  # every name, not only the optimizer's: a buffer's mean is written too
        for name, value in values.items():
            if not all_finite(value):
                raise ValueError(f"outer step: tensor {name!r} has NaN or Inf values")
    through_optimizer = {
        name: value
        for name, value in values.items()
        if _uses_optimizer(TensorKind(kinds[name]), policy)
    }
    optimizer.step(
        masters,
        through_optimizer,
        divisors=None if divisors is None else {n: divisors[n] for n in through_optimizer},
        finite=True,  # scanned above, or proven finite by the caller
    )
    for name, value in values.items():
        if name not in through_optimizer:
            mean = value if divisors is None else value.div_(divisors[name])
            _assign_mean(masters[name], mean, TensorKind(kinds[name]))
    return [name for name in masters if name in values]
