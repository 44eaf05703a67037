"""A worker's own checkpoints: resuming from one (before and after joining) and saving one.

`Resumption` is a part of `DiLoCoWorker` that never sees the worker: it is told what it needs
when called (the server's round after the join, the worker's `Progress` when it saves) and
answers with what the worker sets on itself (the checkpoint it resumed, a `Rejoined`). It
holds only what is fixed for the run: the model, optimizer and scheduler a checkpoint restores,
and the worker's checkpoint directory. In a torch.distributed group rank 0 loads and saves the
checkpoint; the other ranks resume by the counters rank 0 shares (their trainer restores their
model, optimizer and RNG).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from diloco.worker.errors import ServerError
from diloco.worker.parallel import distributed
from diloco.worker.state.checkpoint import Checkpointer, WorkerCheckpoint

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("diloco.worker")


class HeldLeases(Protocol):
    """The client call that tells whether the server still leases us a saved round's units."""

    def leases(self, worker_id: str, dataset_id: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Progress:
    """What a checkpoint keeps of the worker beside its model, optimizer, scheduler and RNG."""

    worker_id: str
    identity: Mapping[str, Any]  # the session's, so that a restart registers as itself
    rounds: int
    local_step: int
    anchor: Mapping[str, torch.Tensor]
    anchor_round: int
    steps_in_round: int
    window: int  # H of the window under way (DyLU may have lowered it)
    tokens: int
    round_tokens: Mapping[str, int]  # a checkpoint inside a round goes on with its count
    data: Mapping[str, Any] | None  # the data source's position
    residual: Mapping[str, torch.Tensor]  # error feedback, valid for residual_key only
    residual_key: str | None


@dataclass(frozen=True)
class InsideRound:
    """A round resumed where its checkpoint left it (the model already holds its steps)."""

    steps: int
    window: int | None  # its H when saved; None: the schedule's stands
    tokens: Mapping[str, Any]  # TokenTally.round_state() of then


@dataclass(frozen=True)
class Rejoined:
    """What a resumed worker sets once it has joined (all defaults when it did not resume)."""

    steps_skipped: int = 0  # sync: the rounds committed while it was down, in steps
    dropped_round: bool = False  # its checkpoint's steps inside a round were dropped
    inside_round: InsideRound | None = None


def _share_resumed(saved: WorkerCheckpoint | None) -> WorkerCheckpoint | None:
    """Rank 0's resumed checkpoint, as the facts every rank counts by (steps, round, id):
    the other ranks' model, optimizer and RNG are their trainer's to restore."""
    if distributed.group_size() == 1:
        return saved
    facts = distributed.broadcast_json(None if saved is None else saved.facts())
    return saved if saved is not None or facts is None else WorkerCheckpoint.of_facts(facts)


def _share_flag(flag: bool | None) -> bool:
    return bool(distributed.broadcast_json(flag))


class Resumption:
    """Resuming a worker from its own checkpoint, and saving one (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        checkpoint_dir: str | os.PathLike[str] | None,
        *,
        leader: bool,
        sharded: bool,
    ) -> None:
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._leader, self._sharded = leader, sharded
        self._checkpointer = (
            None
            if checkpoint_dir is None
            else Checkpointer(checkpoint_dir, model, optimizer, scheduler)
        )
        self._saved: WorkerCheckpoint | None = None

    def load(self, worker_id: str | None) -> WorkerCheckpoint | None:
        """Before joining (so that the worker registers under its old id): the checkpoint the
        model, optimizer and RNG were restored from, or None (no checkpoint_dir, none fits)."""
        checkpointer = self._checkpointer
        if checkpointer is None:
            return None
        self._saved = distributed.lead(lambda: checkpointer.resume(worker_id), _share_resumed)
        return self._saved

    def after_join(
        self,
        server_round: int,
        mode: str,
        sync_every: int,
        client: HeldLeases | None,
        worker_id: str | None,
    ) -> Rejoined:
        """Where a resumed worker goes on, now that it has joined at `server_round`. A round
        that goes on gets its trained steps back into the model here; `client` (rank 0's, None
        elsewhere) says whether the server still leases us that round's units."""
        saved = self._saved
        if saved is None:
            return Rejoined()
        skipped = _steps_missed(saved, server_round, mode, sync_every)
        if saved.steps_in_round == 0 or mode == "streaming":
            return Rejoined(skipped)
        if not _round_goes_on(saved, server_round, client, worker_id):
            return Rejoined(skipped, dropped_round=True)
        state = self._model.state_dict()
        if self._leader:  # a group's other ranks take rank 0's (they joined on its weights)
            with torch.no_grad():
                for name, target in state.items():
                    target.copy_(saved.model[name])
        distributed.broadcast_tensors_(state)
        window = saved.extra.get("window")
        inside = InsideRound(
            saved.steps_in_round,
            None if window is None else int(window),
            saved.extra.get("round_tokens", {}),
        )
        return Rejoined(skipped, inside_round=inside)

    def save(
        self,
        progress: Callable[[], Progress],
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        """Save now, into `directory` if given (a trainer's checkpoint folder), else into the
        checkpoint_dir if the worker has one. `progress` is read only when a save happens: in a
        group rank 0 saves the group's state and the other ranks do nothing."""
        if directory is not None and self._sharded:
            raise ValueError(
                "saving a worker checkpoint is for unsharded workers: under FSDP each rank "
                "holds rows of the anchor, and their state is not saved"
            )
        if not self._leader:
            return
        checkpointer = self._checkpointer
        if directory is not None:
            checkpointer = Checkpointer(directory, self._model, self._optimizer, self._scheduler)
        if checkpointer is None:
            return
        now = progress()
        extra: dict[str, Any] = {
            **now.identity,
            "rounds": now.rounds,
            # inside a round: what it trained so far, and its H (DyLU may have lowered it)
            "round_tokens": now.round_tokens,
            "window": now.window,
        }
        if now.data is not None:
            extra["data"] = now.data
        if now.residual_key is not None:
            extra["residual_key"] = now.residual_key
        checkpointer.save(
            worker_id=now.worker_id,
            anchor=now.anchor,
            anchor_round=now.anchor_round,
            local_step=now.local_step,
            steps_in_round=now.steps_in_round,
            tokens=now.tokens,
            extra=extra,
            residual=now.residual,
        )


def _round_samples_released(
    saved: WorkerCheckpoint, client: HeldLeases | None, worker_id: str | None
) -> bool:
    """The saved round trained leased samples, and the server no longer leases us some
    unit they came from (it evicted us and gave our units to the pool; within one round
    none of ours completes), or no longer knows the dataset."""
    data = saved.extra.get("data")
    if not data or client is None:
        return False
    ours = {int(unit["unit_id"]) for unit in data.get("queue", [])}
    ours |= {int(unit) for unit in data.get("finished", [])}
    if not ours:
        return False
    assert worker_id is not None
    try:
        held = client.leases(worker_id, data["dataset_id"])["units"]
    except ServerError as exc:
        if exc.kind == "unknown_dataset":
            return True
        raise
    return not ours <= {int(unit["unit_id"]) for unit in held}


def _steps_missed(saved: WorkerCheckpoint, server_round: int, mode: str, every: int) -> int:
    """Sync mode: rounds committed while we were down already hold our work (the barrier
    waited for us) or went on without us (we were evicted): either way we start at the
    server's round, and our step count and data position follow it."""
    if mode != "sync" or server_round <= saved.anchor_round:
        return 0
    missed = server_round - saved.anchor_round
    ahead = missed * every
    log.warning("the server is %d round(s) past our checkpoint: skipping %d steps", missed, ahead)
    return ahead


def _round_goes_on(
    saved: WorkerCheckpoint,
    server_round: int,
    client: HeldLeases | None,
    worker_id: str | None,
) -> bool:
    """A checkpoint taken inside a round (a trainer's own cadence) holds steps trained since
    the anchor. Joining put the server's weights in the model; while the server is still at
    our anchor's round those are our anchor, so the trained steps go back in and the round
    goes on where it was. If the server has moved on, they are dropped (with a warning);
    so are they when the server gave the round's leased samples to others meanwhile."""
    if server_round != saved.anchor_round:
        log.warning(
            "the server is at round %d, our checkpoint inside round %d: its %d step(s) "
            "into that round are dropped",
            server_round,
            saved.anchor_round,
            saved.steps_in_round,
        )
        return False
    if distributed.lead(lambda: _round_samples_released(saved, client, worker_id), _share_flag):
        log.warning(
            "we were evicted while down and our leased units went back to the pool: the "
            "%d step(s) of our checkpoint inside round %d are dropped, or others would "
            "train their samples again",
            saved.steps_in_round,
            saved.anchor_round,
        )
        return False
    return True
