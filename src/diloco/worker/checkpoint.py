"""Worker-side checkpoints: a restarted worker resumes under its id without losing local steps.

One checkpoint is one CheckpointStore generation (atomic, checksummed, the newest two kept):
safetensors groups for the model, the fp32 anchor, the inner optimizer's tensors and the RNG
tensors, and JSON metadata for everything else. Nothing is pickled: the optimizer and scheduler
state dicts go through a small tagged JSON encoding (tuples, non-finite floats, non-string keys
and tensor references survive the round trip exactly) so that loading them into a fresh model
and optimizer continues training bit for bit as if the worker had never stopped.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco.algorithm import classify_tensors
from diloco.checkpoints import CheckpointStore
from diloco.wire import TensorSpec, fingerprint, first_difference, specs_of

try:  # numpy is optional: its RNG is saved only where it is installed
    import numpy
except ImportError:  # pragma: no cover - numpy ships with the dev environment
    numpy = None  # type: ignore[assignment]

__all__ = [
    "CHECKPOINT_KIND",
    "FORMAT_VERSION",
    "WorkerCheckpoint",
    "load_worker_checkpoint",
    "restore_worker_checkpoint",
    "save_worker_checkpoint",
]

log = logging.getLogger("diloco.worker")

CHECKPOINT_KIND = "diloco-worker"
FORMAT_VERSION = 1
KEEP = 2

# Anything with state_dict()/load_state_dict(): torch's LRScheduler or a user's own.
Scheduler = Any


@dataclass(frozen=True, eq=False)
class WorkerCheckpoint:
    """A loaded checkpoint that fits the model and optimizer it was loaded against."""

    worker_id: str
    local_step: int
    anchor_round: int
    steps_in_round: int
    tokens: int
    leases: list[dict[str, Any]]
    extra: dict[str, Any]  # JSON the caller saved with it (session, data position, ...)
    generation: int
    path: Path
    model: dict[str, torch.Tensor] = field(repr=False)
    anchor: dict[str, torch.Tensor] = field(repr=False)
    optimizer_state: dict[str, Any] = field(repr=False)
    scheduler_state: dict[str, Any] | None = field(repr=False)
    rng_tensors: dict[str, torch.Tensor] = field(repr=False)
    metadata: dict[str, Any] = field(repr=False)


# ----------------------------------------------------------------- saving


def save_worker_checkpoint(
    directory: str | os.PathLike[str],
    *,
    worker_id: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    anchor: Mapping[str, torch.Tensor],
    anchor_round: int,
    local_step: int,
    steps_in_round: int = 0,
    tokens: int = 0,
    leases: Iterable[Mapping[str, Any]] = (),
    scheduler: Scheduler | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write one new generation under `directory` and return its path; keeps the newest two.

    Reads state only (no RNG draw, no in-place change), so training goes on undisturbed.
    """
    facts = _worker_facts(worker_id, local_step, anchor_round, steps_in_round, tokens, leases)
    extra_json = dict(extra or {})
    _check_plain_json(extra_json, "extra")
    facts["extra"] = extra_json
    optimizer_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = _encode(optimizer.state_dict(), "", optimizer_tensors, "optimizer state")
    scheduler_json = None
    if scheduler is not None:
        scheduler_json = _encode(scheduler.state_dict(), "", None, "scheduler state")
    rng_tensors, rng_json = _capture_rng()
    metadata = {
        "kind": CHECKPOINT_KIND,
        "format": FORMAT_VERSION,
        "worker": facts,
        "model": _model_facts(model),
        "optimizer": {
            "class": _class_name(optimizer),
            "groups": _group_names(model, optimizer),
            "state": optimizer_json,
        },
        "scheduler": None
        if scheduler is None
        else {"class": _class_name(scheduler), "state": scheduler_json},
        "rng": rng_json,
    }
    tensors = {
        "model": _tensors_of(model.state_dict()),
        "anchor": dict(anchor),
        "optimizer": optimizer_tensors,
        "rng": rng_tensors,
    }
    store = _writable_store(Path(directory))
    existing = store.generations()
    try:
        return store.write(existing[-1] + 1 if existing else 0, tensors, metadata)
    except PermissionError as error:
        raise ValueError(f"cannot write a worker checkpoint in {directory}: {error}") from None


def _worker_facts(
    worker_id: str,
    local_step: int,
    anchor_round: int,
    steps_in_round: int,
    tokens: int,
    leases: Iterable[Mapping[str, Any]],
) -> dict[str, Any]:
    """The worker's counters as JSON, checked now so a bad value never reaches the disk."""
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
    counters = {
        "local_step": local_step,
        "anchor_round": anchor_round,
        "steps_in_round": steps_in_round,
        "tokens": tokens,
    }
    for name, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    lease_list = []
    for index, lease in enumerate(leases):
        if not isinstance(lease, Mapping):
            raise ValueError(f"lease {index} is a {type(lease).__name__}, not a dict")
        _check_plain_json(lease, f"lease {index}")
        lease_list.append(dict(lease))
    return {"worker_id": worker_id, **counters, "leases": lease_list}


def _model_facts(model: nn.Module) -> dict[str, Any]:
    """Parameter names and shapes in order (what optimizer state indices refer to) and specs."""
    specs = _specs(model)
    return {
        "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()],
        "specs": [spec.to_json() for spec in specs],
        "fingerprint": fingerprint(specs),
    }


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by model name, so a reordered optimizer is caught."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [
        [names.get(id(p), f"<not in the model: {list(p.shape)}>") for p in group["params"]]
        for group in optimizer.param_groups
    ]


def _writable_store(directory: Path) -> CheckpointStore:
    """The store under `directory`, created if missing; a read-only place is a ValueError."""
    try:
        store = CheckpointStore(directory, keep=KEEP)
    except OSError as error:
        raise ValueError(
            f"cannot create worker checkpoint directory {directory}: {error}"
        ) from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"worker checkpoint directory {directory} is not writable")
    return store


def _tensors_of(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _specs(model: nn.Module) -> list[TensorSpec]:
    return specs_of(model.state_dict(), classify_tensors(model))


def _class_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


# ----------------------------------------------------------------- RNG


def _capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every generator training may draw from: torch CPU and CUDA, Python, numpy."""
    tensors = {"torch": torch.get_rng_state()}
    cuda_devices = 0
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{index}"] = state
            cuda_devices += 1
    facts: dict[str, Any] = {
        "python": _encode(random.getstate(), "", None, "python RNG state"),
        "cuda_devices": cuda_devices,
        "numpy": None,
    }
    if numpy is not None:
        name, keys, position, has_gauss, cached = numpy.random.get_state(legacy=True)
        facts["numpy"] = [name, [int(k) for k in keys], int(position), int(has_gauss), cached]
    return tensors, facts


def _restore_rng(tensors: Mapping[str, torch.Tensor], facts: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"].clone())
    saved_cuda = int(facts.get("cuda_devices", 0))
    if saved_cuda and torch.cuda.is_available():
        present = torch.cuda.device_count()
        if present != saved_cuda:
            log.warning(
                "the checkpoint has CUDA RNG state for %d devices, this process sees %d; "
                "restoring the first %d",
                saved_cuda,
                present,
                min(saved_cuda, present),
            )
        for index in range(min(saved_cuda, present)):
            torch.cuda.set_rng_state(tensors[f"cuda.{index}"].clone(), device=index)
    random.setstate(_decode(facts["python"], {}))
    saved_numpy = facts.get("numpy")
    if numpy is not None and saved_numpy is not None:
        name, keys, position, has_gauss, cached = saved_numpy
        array = numpy.array(keys, dtype=numpy.uint32)
        numpy.random.set_state((name, array, position, has_gauss, cached))


# ----------------------------------------------------------------- loading


def load_worker_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None = None,
) -> WorkerCheckpoint | None:
    """The newest checkpoint if it fits `model`, `optimizer` and `scheduler`; else None.

    Touches neither the model nor the optimizer: call restore_worker_checkpoint to apply it.
    A checkpoint that does not fit is logged (naming the first difference) and ignored, so a
    worker whose model changed starts fresh rather than crashing or loading wrong state.
    """
    path = Path(directory)
    if not path.is_dir():
        return None
    loaded = CheckpointStore(path, keep=KEEP).load_latest()
    if loaded is None:
        if any(".tmp-" not in entry.name for entry in path.glob("gen-*")):
            log.warning("no usable worker checkpoint in %s; starting fresh", path)
        return None
    problem = _mismatch(loaded.metadata, model, optimizer, scheduler)
    if problem is not None:
        log.warning("ignoring worker checkpoint %s: %s", loaded.path, problem)
        return None
    try:
        return _build(loaded.generation, loaded.path, loaded.tensors, loaded.metadata)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        log.warning("ignoring worker checkpoint %s: it is malformed (%r)", loaded.path, error)
        return None


def _build(
    generation: int,
    path: Path,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    metadata: dict[str, Any],
) -> WorkerCheckpoint:
    """Decode the JSON halves; optimizer tensors are cloned so training never aliases them."""
    facts = metadata["worker"]
    optimizer_tensors = {name: t.clone() for name, t in tensors["optimizer"].items()}
    scheduler = metadata["scheduler"]
    return WorkerCheckpoint(
        worker_id=str(facts["worker_id"]),
        local_step=int(facts["local_step"]),
        anchor_round=int(facts["anchor_round"]),
        steps_in_round=int(facts["steps_in_round"]),
        tokens=int(facts["tokens"]),
        leases=[dict(lease) for lease in facts["leases"]],
        extra=dict(facts.get("extra") or {}),
        generation=generation,
        path=path,
        model=dict(tensors["model"]),
        anchor=dict(tensors["anchor"]),
        optimizer_state=_decode(metadata["optimizer"]["state"], optimizer_tensors),
        scheduler_state=None if scheduler is None else _decode(scheduler["state"], {}),
        rng_tensors=dict(tensors["rng"]),
        metadata=metadata,
    )


def restore_worker_checkpoint(
    checkpoint: WorkerCheckpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None = None,
) -> None:
    """Load model weights, optimizer, scheduler and every RNG; the RNG last, so nothing after
    it draws. Raises ValueError (touching nothing) if they do not fit the checkpoint."""
    problem = _mismatch(checkpoint.metadata, model, optimizer, scheduler)
    if problem is not None:
        raise ValueError(f"worker checkpoint {checkpoint.path} does not fit: {problem}")
    state = model.state_dict()
    with torch.no_grad():
        for name, target in _tensors_of(state).items():
            target.copy_(checkpoint.model[name])
    optimizer.load_state_dict(checkpoint.optimizer_state)
    if scheduler is not None and checkpoint.scheduler_state is not None:
        scheduler.load_state_dict(checkpoint.scheduler_state)
    _restore_rng(checkpoint.rng_tensors, checkpoint.metadata["rng"])


# ----------------------------------------------------------------- validation


def _mismatch(
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
    specs = _specs(model)
    if fingerprint(specs) == saved["fingerprint"]:
        return None
    saved_specs = [TensorSpec.from_json(spec) for spec in saved["specs"]]
    difference = first_difference(specs, saved_specs)
    return f"the model's tensors differ: {difference or 'the fingerprint differs'}"


def _optimizer_mismatch(
    saved: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    if saved["class"] != _class_name(optimizer):
        return (
            f"the optimizer is {saved['class']} in the checkpoint but {_class_name(optimizer)} here"
        )
    saved_groups = saved["groups"]
    groups = _group_names(model, optimizer)
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
        return f"the checkpoint has no LR scheduler state, but a {_class_name(scheduler)} is given"
    if scheduler is None:
        return f"the checkpoint has {saved['class']} LR scheduler state, but no scheduler is given"
    if saved["class"] != _class_name(scheduler):
        return (
            f"the LR scheduler is {saved['class']} in the checkpoint but "
            f"{_class_name(scheduler)} here"
        )
    return None


def _brief(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


# ----------------------------------------------------------------- tagged JSON


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor] | None, what: str) -> Any:
    """`value` as JSON that _decode turns back into an equal value of the same types.

    Tensors go to `tensors` under their dotted path (e.g. `state.0.exp_avg`) and are replaced
    by a reference; with `tensors` None a tensor, like any other non-JSON value, is a
    ValueError naming its key. Tuples, non-finite floats and dicts whose keys are not plain
    strings are tagged objects, so that nothing changes type on the way back.
    """
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise ValueError(f"{what} key {path!r} holds a tensor, which is not JSON-able")
        if path in tensors:  # e.g. the keys 0 and "0" of one dict
            raise ValueError(f"{what} has two tensors under the key {path!r}")
        tensors[path] = value.detach()
        return {"$tensor": path}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, (list, tuple)):
        items = [_encode(item, _join(path, i), tensors, what) for i, item in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {
                key: _encode(item, _join(path, key), tensors, what) for key, item in value.items()
            }
        return {
            "$dict": [
                [
                    _encode(key, _join(path, key), None, what),
                    _encode(item, _join(path, key), tensors, what),
                ]
                for key, item in value.items()
            ]
        }
    raise ValueError(f"{what} key {path!r} holds a {type(value).__name__}, which is not JSON-able")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of _encode, taking referenced tensors from `tensors`."""
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tensor":
            return tensors[inner]
        if tag == "$tuple":
            return tuple(_decode(item, tensors) for item in inner)
        if tag == "$float":
            return float(inner)
        if tag == "$dict":
            return {_decode(key, tensors): _decode(item, tensors) for key, item in inner}
    return {key: _decode(item, tensors) for key, item in value.items()}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_plain_json(value: Any, what: str, path: str = "") -> None:
    """Leases are opaque JSON: plain values, lists and string-keyed dicts only."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float) and math.isfinite(value):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain_json(item, what, _join(path, index))
        return
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        for key, item in value.items():
            _check_plain_json(item, what, _join(path, key))
        return
    raise ValueError(f"{what} key {path!r} holds a {type(value).__name__}, which is not JSON")
