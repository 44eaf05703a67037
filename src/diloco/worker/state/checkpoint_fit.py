"""Does a worker checkpoint fit the model, optimizer and scheduler it is loaded against?

A checkpoint records the model's parameter names and shapes in order (what optimizer state
indices refer to), its tensor specs and fingerprint (buffers count too: the same fingerprint
the server checks at registration), the optimizer's class and param groups by parameter name,
and the scheduler's class. Loading into anything else would continue training from wrong
state, so the first difference is named and the checkpoint ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from diloco.algorithm import classify_tensors
from diloco.wire import TensorSpec, fingerprint, first_difference, specs_of

CHECKPOINT_KIND = "diloco-worker"
FORMAT_VERSION = 1

# Anything with state_dict()/load_state_dict(): torch's LRScheduler or a user's own.
Scheduler = Any


def model_facts(model: nn.Module) -> dict[str, Any]:
    """Parameter names and shapes in order (what optimizer state indices refer to) and specs."""
    specs = model_specs(model)
    return {
        "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()],
        "specs": [spec.to_json() for spec in specs],
        "fingerprint": fingerprint(specs),
    }


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by model name, so a reordered optimizer is caught."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [
        [names.get(id(p), f"<not in the model: {list(p.shape)}>") for p in group["params"]]
        for group in optimizer.param_groups
    ]


def model_specs(model: nn.Module) -> list[TensorSpec]:
    return specs_of(model.state_dict(), classify_tensors(model))


def class_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def mismatch(
    metadata: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
) -> str | None:
    """A sentence naming the first way the checkpoint does not fit; None when it fits."""
    if metadata.get("kind") != CHECKPOINT_KIND:
        return "it is not a worker checkpoint"
    if metadata.get("format") != FORMAT_VERSION:
        return (
            f"it has format version {metadata.get('format')!r}; "
            f"this code reads version {FORMAT_VERSION}"
        )
    try:
        return (
            _parameter_mismatch(metadata["model"]["parameters"], model)
            or _spec_mismatch(metadata["model"], model)
            or _optimizer_mismatch(metadata["optimizer"], model, optimizer)
            or _scheduler_mismatch(metadata["scheduler"], scheduler)
        )
    except (KeyError, TypeError, ValueError, IndexError) as error:
        return f"its metadata is malformed ({error!r})"


def _parameter_mismatch(saved: Sequence[Sequence[Any]], model: nn.Module) -> str | None:
    """The first parameter whose name, position or shape differs (optimizer state follows it)."""
    current = [(name, list(p.shape)) for name, p in model.named_parameters()]
    saved_names = [name for name, _ in saved]
    current_names = {name for name, _ in current}
    for index, ((old, old_shape), (new, new_shape)) in enumerate(zip(saved, current, strict=False)):
        if old != new:
            if old in current_names and new in saved_names:
                return (
                    f"the parameter order differs: position {index} is {old!r} in the "
                    f"checkpoint but {new!r} in the model"
                )
            if old not in current_names:
                return (
                    f"parameter {old!r} (position {index}) of the checkpoint is not in the "
                    f"model, which has {new!r} there"
                )
            return f"parameter {new!r} (position {index}) of the model is not in the checkpoint"
        if list(old_shape) != new_shape:
            return (
                f"parameter {old!r} has shape {list(old_shape)} in the checkpoint but "
                f"{new_shape} in the model"
            )
    if len(saved) != len(current):
        extra = saved[len(current)][0] if len(saved) > len(current) else current[len(saved)][0]
        return (
            f"the checkpoint has {len(saved)} parameters, the model {len(current)} "
            f"(first unmatched: {extra!r})"
        )
    return None


def _spec_mismatch(saved: Mapping[str, Any], model: nn.Module) -> str | None:
    """Buffers count too: the same fingerprint the server checks at registration."""
    specs = model_specs(model)
    if fingerprint(specs) == saved["fingerprint"]:
        return None
    saved_specs = [TensorSpec.from_json(spec) for spec in saved["specs"]]
    difference = first_difference(specs, saved_specs)
    return f"the model's tensors differ: {difference or 'the fingerprint differs'}"


def _optimizer_mismatch(
    saved: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    if saved["class"] != class_name(optimizer):
        return (
            f"the optimizer is {saved['class']} in the checkpoint but {class_name(optimizer)} here"
        )
    saved_groups = saved["groups"]
    groups = group_names(model, optimizer)
    if len(saved_groups) != len(groups):
        return (
            f"the checkpoint has {len(saved_groups)} optimizer param groups, "
            f"the optimizer has {len(groups)}"
        )
    for index, (old, new) in enumerate(zip(saved_groups, groups, strict=True)):
        if old != new:
            return (
                f"optimizer param group {index} holds {len(old)} parameters {_brief(old)} in "
                f"the checkpoint but {len(new)} parameters {_brief(new)} in the optimizer"
            )
    return None


def _scheduler_mismatch(saved: Mapping[str, Any] | None, scheduler: Scheduler | None) -> str | None:
    if saved is None and scheduler is None:
        return None
    if saved is None:
        return f"the checkpoint has no LR scheduler state, but a {class_name(scheduler)} is given"
    if scheduler is None:
        return f"the checkpoint has {saved['class']} LR scheduler state, but no scheduler is given"
    if saved["class"] != class_name(scheduler):
        return (
            f"the LR scheduler is {saved['class']} in the checkpoint but "
            f"{class_name(scheduler)} here"
        )
    return None


def _brief(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"
