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
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco.checkpoints import CheckpointStore
from diloco.worker.state.checkpoint_fit import (
    CHECKPOINT_KIND,
    FORMAT_VERSION,
    Scheduler,
    class_name,
    group_names,
    mismatch,
    model_facts,
)
from diloco.worker.state.checkpoint_json import check_plain_json, decode, encode

try:  # numpy is optional: its RNG is saved only where it is installed
    import numpy
except ImportError:  # pragma: no cover - numpy ships with the dev environment
    numpy = None  # type: ignore[assignment]

__all__ = [
    "CHECKPOINT_KIND",
    "FORMAT_VERSION",
    "Checkpointer",
    "WorkerCheckpoint",
    "load_worker_checkpoint",
    "restore_worker_checkpoint",
    "save_worker_checkpoint",
]

log = logging.getLogger("diloco.worker")

KEEP = 2


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
    # error-feedback residuals (worker/upload_coder.py); their key is extra["residual_key"]
    residual: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def facts(self) -> dict[str, Any]:
        """The counters a torch.distributed group's other ranks resume by (JSON)."""
        return {
            "worker_id": self.worker_id,
            "local_step": self.local_step,
            "anchor_round": self.anchor_round,
            "steps_in_round": self.steps_in_round,
            "tokens": self.tokens,
            "extra": {
                k: self.extra[k] for k in ("rounds", "round_tokens", "window") if k in self.extra
            },
            "generation": self.generation,
            "path": str(self.path),
        }

    @classmethod
    def of_facts(cls, facts: Mapping[str, Any]) -> WorkerCheckpoint:
        """What a follower rank knows of rank 0's checkpoint: its counters, no tensors."""
        return cls(
            worker_id=str(facts["worker_id"]),
            local_step=int(facts["local_step"]),
            anchor_round=int(facts["anchor_round"]),
            steps_in_round=int(facts["steps_in_round"]),
            tokens=int(facts["tokens"]),
            leases=[],
            extra=dict(facts["extra"]),
            generation=int(facts["generation"]),
            path=Path(facts["path"]),
            model={},
            anchor={},
            optimizer_state={},
            scheduler_state=None,
            rng_tensors={},
            metadata={},
        )


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
    residual: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write one new generation under `directory` and return its path; keeps the newest two.

    Reads state only (no RNG draw, no in-place change), so training goes on undisturbed.
    """
    facts = _worker_facts(worker_id, local_step, anchor_round, steps_in_round, tokens, leases)
    extra_json = dict(extra or {})
    check_plain_json(extra_json, "extra")
    facts["extra"] = extra_json
    optimizer_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = encode(optimizer.state_dict(), "", optimizer_tensors, "optimizer state")
    scheduler_json = None
    if scheduler is not None:
        scheduler_json = encode(scheduler.state_dict(), "", None, "scheduler state")
    rng_tensors, rng_json = _capture_rng()
    metadata = {
        "kind": CHECKPOINT_KIND,
        "format": FORMAT_VERSION,
        "worker": facts,
        "model": model_facts(model),
        "optimizer": {
            "class": class_name(optimizer),
            "groups": group_names(model, optimizer),
            "state": optimizer_json,
        },
        "scheduler": None
        if scheduler is None
        else {"class": class_name(scheduler), "state": scheduler_json},
        "rng": rng_json,
    }
    tensors = {
        "model": _tensors_of(model.state_dict()),
        "anchor": dict(anchor),
        "optimizer": optimizer_tensors,
        "rng": rng_tensors,
    }
    if residual:
        tensors["residual"] = dict(residual)
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
        check_plain_json(lease, f"lease {index}")
        lease_list.append(dict(lease))
    return {"worker_id": worker_id, **counters, "leases": lease_list}


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
        "python": encode(random.getstate(), "", None, "python RNG state"),
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
    random.setstate(decode(facts["python"], {}))
    saved_numpy = facts.get("numpy")
    if numpy is not None and saved_numpy is not None:
        name, keys, position, has_gauss, cached = saved_numpy
        array = numpy.array(keys, dtype=numpy.uint32)
        numpy.random.set_state((name, array, position, has_gauss, cached))


# ----------------------------------------------------------------- loading


def holds_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds a worker checkpoint (usable or not): the worker that wrote it
    reached a server before."""
    return any(".tmp-" not in entry.name for entry in Path(directory).glob("gen-*"))


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
        if holds_checkpoint(path):
            log.warning("no usable worker checkpoint in %s; starting fresh", path)
        return None
    problem = mismatch(loaded.metadata, model, optimizer, scheduler)
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
        optimizer_state=decode(metadata["optimizer"]["state"], optimizer_tensors),
        scheduler_state=None if scheduler is None else decode(scheduler["state"], {}),
        rng_tensors=dict(tensors["rng"]),
        metadata=metadata,
        residual={name: t.clone() for name, t in tensors.get("residual", {}).items()},
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
    problem = mismatch(checkpoint.metadata, model, optimizer, scheduler)
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


# ----------------------------------------------------------------- the worker's checkpointer


class Checkpointer:
    """One worker's checkpoints in `directory`: its model, inner optimizer and `scheduler`,
    RNG state and the facts the worker hands over (ids, counters, data position).

    The worker saves after every round (streaming: every cycle) and resumes from the newest
    checkpoint that fits, under the id it was saved with.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.directory = directory
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler

    def resume(self, worker_id: str | None) -> WorkerCheckpoint | None:
        """Restore the newest checkpoint into the model, optimizer, scheduler and RNG and
        return it; None (touching nothing) if there is none that fits, or it is another
        worker's than `worker_id` (None: whoever's it is)."""
        saved = load_worker_checkpoint(
            self.directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if saved is None:
            return None
        if worker_id is not None and worker_id != saved.worker_id:
            log.warning(
                "the checkpoint in %s is worker %r's, not %r's: starting fresh",
                self.directory,
                saved.worker_id,
                worker_id,
            )
            return None
        restore_worker_checkpoint(
            saved, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        log.warning(
            "worker %s resumes at local step %d (round %d) from %s",
            saved.worker_id,
            saved.local_step,
            saved.anchor_round,
            saved.path,
        )
        return saved

    def save(
        self,
        *,
        worker_id: str,
        anchor: Mapping[str, torch.Tensor],
        anchor_round: int,
        local_step: int,
        steps_in_round: int,
        tokens: int,
        extra: Mapping[str, Any],
        residual: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write a new generation now (training goes on undisturbed: state is only read)."""
        return save_worker_checkpoint(
            self.directory,
            worker_id=worker_id,
            model=self.model,
            optimizer=self.optimizer,
            anchor=anchor,
            anchor_round=anchor_round,
            local_step=local_step,
            steps_in_round=steps_in_round,
            tokens=tokens,
            scheduler=self.scheduler,
            extra=extra,
            residual=residual,
        )
