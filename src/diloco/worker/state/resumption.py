"""A worker's own checkpoints: resuming from one (before and after joining) and saving one.

A mixin of `DiLoCoWorker`, which holds the parts it reads and sets (model, schedule, token
tally, session, upload coder). In a torch.distributed group rank 0 loads and saves the
checkpoint; the other ranks resume by the counters rank 0 shares (their trainer restores their
model, optimizer and RNG).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from diloco.worker.errors import ServerError
from diloco.worker.parallel import distributed
from diloco.worker.state.checkpoint import Checkpointer, WorkerCheckpoint

if TYPE_CHECKING:
    from torch import nn

    from diloco.worker.data.tokens import TokenTally
    from diloco.worker.data.units import UnitReports
    from diloco.worker.net.client import DiLoCoClient
    from diloco.worker.schedule import EveryH
    from diloco.worker.session import ServerSession
    from diloco.worker.settings import WorkerSettings
    from diloco.worker.upload_coder import UploadCoder

log = logging.getLogger("diloco.worker")


def _share_resumed(saved: WorkerCheckpoint | None) -> WorkerCheckpoint | None:
    """Rank 0's resumed checkpoint, as the facts every rank counts by (steps, round, id):
    the other ranks' model, optimizer and RNG are their trainer's to restore."""
    if distributed.group_size() == 1:
        return saved
    facts = distributed.broadcast_json(None if saved is None else saved.facts())
    return saved if saved is not None or facts is None else WorkerCheckpoint.of_facts(facts)


def _share_flag(flag: bool | None) -> bool:
    return bool(distributed.broadcast_json(flag))


class WorkerResumption:
    """Resuming and saving a worker checkpoint (see the module docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    worker_id: str | None
    is_leader: bool
    sharded: bool
    local_step: int
    rounds: int
    resumed: WorkerCheckpoint | None
    dropped_round: bool
    settings: WorkerSettings
    _checkpointer: Checkpointer | None
    _scheduler: Any
    _schedule: EveryH
    _tokens: TokenTally
    _units: UnitReports
    _uploads: UploadCoder
    client: DiLoCoClient | None

    @property
    def round(self) -> int:
        raise NotImplementedError

    @property
    def anchor(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _leader_session(self) -> ServerSession:
        raise NotImplementedError

    def _resume(self, checkpointer: Checkpointer) -> None:
        """Restore a saved worker (before joining, so that it registers under its old id)."""
        saved = distributed.lead(lambda: checkpointer.resume(self.worker_id), _share_resumed)
        if saved is None:
            return
        self.worker_id = saved.worker_id
        self.local_step = saved.local_step
        self._tokens.total = saved.tokens
        self.rounds = int(saved.extra.get("rounds", 0))
        self.resumed = saved

    def _skip_rounds_missed(self) -> None:
        """Sync mode: rounds committed while we were down already hold our work (the barrier
        waited for us) or went on without us (we were evicted): either way we start at the
        server's round, and our step count and data position follow it."""
        saved = self.resumed
        if self.settings.mode != "sync" or saved is None or self.round <= saved.anchor_round:
            return
        missed = self.round - saved.anchor_round
        ahead = missed * self.settings.sync_every
        self.local_step += ahead
        log.warning(
            "the server is %d round(s) past our checkpoint: skipping %d steps", missed, ahead
        )

    def _resume_mid_round(self) -> None:
        """A checkpoint taken inside a round (a trainer's own cadence) holds steps trained since
        the anchor. Joining put the server's weights in the model; while the server is still at
        our anchor's round those are our anchor, so the trained steps go back in and the round
        goes on where it was. If the server has moved on, they are dropped (with a warning);
        so are they when the server gave the round's leased samples to others meanwhile."""
        saved = self.resumed
        if saved is None or saved.steps_in_round == 0 or self.settings.mode == "streaming":
            return
        if self.round != saved.anchor_round:
            self.dropped_round = True
            log.warning(
                "the server is at round %d, our checkpoint inside round %d: its %d step(s) "
                "into that round are dropped",
                self.round,
                saved.anchor_round,
                saved.steps_in_round,
            )
            return
        if distributed.lead(lambda: self._round_samples_released(saved), _share_flag):
            self.dropped_round = True
            log.warning(
                "we were evicted while down and our leased units went back to the pool: the "
                "%d step(s) of our checkpoint inside round %d are dropped, or others would "
                "train their samples again",
                saved.steps_in_round,
                saved.anchor_round,
            )
            return
        state = self.model.state_dict()
        if self.is_leader:  # a group's other ranks take rank 0's (they joined on its weights)
            with torch.no_grad():
                for name, target in state.items():
                    target.copy_(saved.model[name])
        distributed.broadcast_tensors_(state)
        self._schedule.steps_in_round = saved.steps_in_round
        self._schedule.window = int(saved.extra.get("window", self._schedule.window))
        self._tokens.resume_round(saved.extra.get("round_tokens", {}))

    def _round_samples_released(self, saved: WorkerCheckpoint) -> bool:
        """The saved round trained leased samples, and the server no longer leases us some
        unit they came from (it evicted us and gave our units to the pool; within one round
        none of ours completes), or no longer knows the dataset."""
        data = saved.extra.get("data")
        if not data or self.client is None:
            return False
        ours = {int(unit["unit_id"]) for unit in data.get("queue", [])}
        ours |= {int(unit) for unit in data.get("finished", [])}
        if not ours:
            return False
        assert self.worker_id is not None
        try:
            held = self.client.leases(self.worker_id, data["dataset_id"])["units"]
        except ServerError as exc:
            if exc.kind == "unknown_dataset":
                return True
            raise
        return not ours <= {int(unit["unit_id"]) for unit in held}

    def save_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Save the worker's state now (done after every round when checkpoint_dir is set),
        into `directory` if given (a trainer's checkpoint folder; mid-round is fine: the
        anchor, the steps into the round and the residual are saved with the model). In a
        torch.distributed group rank 0 saves the group's state; the other ranks do nothing."""
        if directory is not None and self.sharded:
            raise ValueError(
                "saving a worker checkpoint is for unsharded workers: under FSDP each rank "
                "holds rows of the anchor, and their state is not saved"
            )
        if not self.is_leader:
            return
        checkpointer = self._checkpointer
        if directory is not None:
            checkpointer = Checkpointer(directory, self.model, self.optimizer, self._scheduler)
        if checkpointer is None or self.worker_id is None:
            return
        extra: dict[str, Any] = {
            **self._leader_session().identity(),
            "rounds": self.rounds,
            # inside a round: what it trained so far, and its H (DyLU may have lowered it)
            "round_tokens": self._tokens.round_state(),
            "window": self._schedule.window,
        }
        data_state = self._units.state()
        if data_state is not None:
            extra["data"] = data_state
        residual, residual_key = self._uploads.state()
        if residual_key is not None:
            extra["residual_key"] = residual_key
        checkpointer.save(
            worker_id=self.worker_id,
            anchor=self.anchor,
            anchor_round=self.round,
            local_step=self.local_step,
            steps_in_round=self._schedule.steps_in_round,
            tokens=self._tokens.total,
            extra=extra,
            residual=residual,
        )
