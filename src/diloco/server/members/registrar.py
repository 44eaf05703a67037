"""Who joins and who leaves: registrations, departures and evictions.

A registration is checked in a fixed order (protocol, then the model against the run's, then
the id) and journaled before it is answered; a departure or an eviction releases the worker's
leased units but those a pending submission still reports, and tells the round engine, whose
barrier may then be complete. Every call happens under the coordinator's lock.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco import faults
from diloco.server.errors import Rejection
from diloco.server.members.membership import Membership
from diloco.server.model.footprint import (
    available_bytes,
    bytes_needed,
    disk_bytes_needed,
    free_disk_bytes,
    model_bytes,
    model_size,
)
from diloco.server.model.global_model import GlobalModel, fragment_plan
from diloco.server.ops.metrics import ServerMetrics
from diloco.server.rounds.engine import RoundEngine
from diloco.server.settings import ServerSettings
from diloco.server.shards.role import ShardRole
from diloco.server.state.journal import RoundJournal
from diloco.server.state.step_inputs import logs_bodies
from diloco.wire import (
    PROTOCOL_VERSION,
    WORKER_ID_PATTERN,
    TensorSpec,
    fingerprint,
    first_difference,
    is_worker_id,
)
from diloco.wire.format.shard_layout import shard_fragment_plan, shard_layout

log = logging.getLogger("diloco.server")


class Registrar:
    """Admits workers into the membership and takes them out, journaled."""

    def __init__(
        self,
        settings: ServerSettings,
        clock: Callable[[], float],
        model: GlobalModel,
        membership: Membership,
        journal: RoundJournal,
        engine: RoundEngine,
        metrics: ServerMetrics,
        role: ShardRole,
        is_banned: Callable[[str], bool] = lambda _worker_id: False,
    ) -> None:
        self.is_banned = is_banned  # ids an admin banned (`RunControl`)
        # one server, shard 0 or another shard: who vouches for a registration, whose plan
        self.role = role
        self.settings = settings
        self.clock = clock
        self.model = model
        self.membership = membership
        self.journal = journal
        self.engine = engine
        self.metrics = metrics
        self._uploader: str | None = None  # who was told to upload the initial weights
        self._registered_plan: list[list[str]] | None = None  # a streaming shard's part
        self._whole_plan: list[list[str]] | None = None  # and the whole model's plan
        self.available_memory: Callable[[], int | None] = available_bytes  # (tests replace it)
        self.free_disk: Callable[[Path], int | None] = free_disk_bytes  # (and this)

    def register(
        self,
        worker_id: str | None,
        specs: Sequence[TensorSpec],
        protocol_version: int,
        session: str | None = None,
        waits_for_initial: bool = False,
    ) -> dict:
        """Admit a worker; checks the protocol, then the model, then the id (in that order).

        A live id is refused (409) unless the request carries the session that registered it:
        that is the same worker retrying a registration whose answer it never received.
        """
        if protocol_version != PROTOCOL_VERSION:
            raise Rejection(
                400,
                "protocol_version",
                f"protocol_version must be {PROTOCOL_VERSION}, got {protocol_version}",
                expected=PROTOCOL_VERSION,
                got=protocol_version,
            )
        if worker_id is not None and not is_worker_id(worker_id):
            raise Rejection(
                422,
                "invalid_request",
                f"field 'worker_id' must match {WORKER_ID_PATTERN}",
                field="worker_id",
                got=worker_id,
            )
        if worker_id is not None and self.is_banned(worker_id):
            raise Rejection(
                403,
                "worker_banned",
                f"worker id {worker_id!r} was banned by an admin "
                "(`diloco admin unban` lets it register again)",
                worker_id=worker_id,
            )
        self.model.require_healthy()
        now = self.clock()
        specs = self._own_part(specs)
        self._check_model(specs)
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:8]}"
        holder = self.membership.get_live(worker_id)
        if holder is not None and session is not None and holder.session == session:
            holder.last_seen = now
            return self._registration(worker_id, waits_for_initial)
        if (
            holder is not None
            and session is not None
            and self.role.known_to_shard0(worker_id, session)
        ):
            # A follower shard: shard 0 holds the id under this new session (the worker
            # restarted without its checkpoint, and shard 0 evicted its old self).
            holder.session, holder.last_seen = session, now
            self.journal.worker_joined(worker_id, session, self.model.version)
            return self._registration(worker_id, waits_for_initial)
        if holder is not None:
            raise Rejection(
                409,
                "worker_id_taken",
                f"worker id {worker_id!r} is held by a live worker",
                worker_id=worker_id,
            )
        # a streaming follower commits rounds alone: only workers shard 0 admitted (not banned)
        if not self.role.admits_alone and not self.role.known_to_shard0(worker_id, session or ""):
            raise Rejection(
                409,
                "not_on_shard_0",
                f"worker {worker_id!r} is not registered on shard 0 under this session: "
                "register there first",
                worker_id=worker_id,
            )
        if self.model.specs is None or not self.model.kinds_known:
            if self.model.fixed_plan is None and self._registered_plan is not None:
                self.model.fixed_plan = self._registered_plan
                self.journal.state.set_meta("fragment_plan", self._registered_plan)
                self.journal.state.set_meta("whole_fragment_plan", self._whole_plan)
            try:
                self.model.set_specs({s.name: s for s in specs}, kinds_known=True)
            except ValueError as exc:  # the model cannot be cut into the fragments asked
                raise Rejection(
                    422,
                    "fragments_do_not_fit",
                    f"this model cannot be split as the server is configured: {exc}",
                    fragments=self.settings.fragments,
                ) from None
            self.journal.save_registered_specs(self.model.specs)
        self.membership.admit(worker_id, now, session)
        self.journal.worker_joined(worker_id, session, self.model.version)
        faults.crash_point("registered")
        log.info("worker %s registered at round %d", worker_id, self.model.version)
        self.engine.on_register(worker_id)
        self.metrics.live_workers.set(len(self.membership.live_ids()))
        return self._registration(worker_id, waits_for_initial)

    def _own_part(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """A shard keeps the tensors the layout gives it of the worker's whole model."""
        shards = self.settings.shards
        if shards == 1:
            return list(specs)
        if self.settings.mode == "streaming":
            return self._own_fragments(specs)
        try:
            layout = shard_layout(list(specs), shards)
        except ValueError as exc:
            raise Rejection(
                422, "shards_do_not_fit", f"this model cannot be split into shards: {exc}"
            ) from None
        owned = set(layout[self.settings.shard])
        return [spec for spec in specs if spec.name in owned]

    def _own_fragments(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """A streaming shard keeps whole fragments of the whole model's plan; the first
        registration (or --init) fixes that plan here (kept in the state, for restarts), and
        later workers, whatever the order of their tensors, get the same part."""
        if self.model.fixed_plan is not None:
            owned = {name for names in self.model.fixed_plan for name in names}
            return [spec for spec in specs if spec.name in owned]
        try:
            if self.role.leads:
                plan = fragment_plan(list(specs), self.settings.fragments)
            else:  # shard 0's, so that every shard cuts the model alike
                plan = self.role.leader_plan()
            mine = shard_fragment_plan(plan, specs, self.settings.shards, self.settings.shard)
        except ValueError as exc:
            raise Rejection(
                422, "shards_do_not_fit", f"this model cannot be split into shards: {exc}"
            ) from None
        except KeyError as exc:
            raise Rejection(
                422,
                "shards_do_not_fit",
                f"shard 0's fragment plan names tensor {exc}, which this worker's model lacks",
            ) from None
        self._registered_plan = mine  # fixed with the model's specs (register)
        self._whole_plan = plan
        owned = {name for names in mine for name in names}
        return [spec for spec in specs if spec.name in owned]

    def _check_model(self, specs: Sequence[TensorSpec]) -> None:
        """422 if a registering worker's model is not the run's (once the run has one); 507
        if the first one's model is more than this machine's memory can hold."""
        if self.model.specs is None:
            self._check_memory(specs)
            self._check_disk(specs)
            return
        run_specs = list(self.model.specs.values())
        difference = first_difference(run_specs, list(specs), "the run's model")
        if difference is not None:
            part = "" if self.settings.shards == 1 else f" in shard {self.settings.shard}'s part"
            raise Rejection(
                422,
                "fingerprint_mismatch",
                f"this server's run was started with another model ({model_size(run_specs)}"
                f"{part}) than this worker's ({model_size(specs)}); first difference: "
                f"{difference}",
                expected=self.model.fingerprint,
                got=fingerprint(list(specs)),
            )

    def _check_memory(self, specs: Sequence[TensorSpec]) -> None:
        needed, available = bytes_needed(specs, self.settings), self.available_memory()
        if available is None or needed <= available:
            return
        model = model_bytes(specs)
        raise Rejection(
            507,
            "insufficient_memory",
            f"this model is {model / 2**20:,.0f} MiB in fp32 and the server needs about "
            f"{needed / 2**30:.1f} GiB to hold it (masters, round sums, outer optimizer state, "
            f"bodies in flight), but this machine has {available / 2**30:.1f} GiB available: "
            "run the server on a machine with more memory, or shard it (diloco cluster "
            "--shards N)",
            model_bytes=model,
            needed_bytes=needed,
            available_bytes=available,
        )

    def _check_disk(self, specs: Sequence[TensorSpec]) -> None:
        """507 if the state dir's disk cannot hold this model's checkpoints and step log."""
        state = self.journal.state
        if state.directory is None or state.checkpoints is None:
            return
        free = self.free_disk(state.directory)
        logged = self.journal.checkpoint_every if self.journal.logs_steps else 0
        bodies = logs_bodies(self.settings, self.journal.logs_steps)  # (the open round's)
        needed = disk_bytes_needed(specs, self.settings, state.checkpoints.keep, logged, bodies)
        if free is None or needed <= free:
            return
        model = model_bytes(specs)
        raise Rejection(
            507,
            "insufficient_storage",
            f"this model is {model / 2**20:,.0f} MiB in fp32 and its state dir "
            f"{state.directory} keeps up to {needed / 2**30:.1f} GiB ({state.checkpoints.keep} "
            f"checkpoints and the one being written, and {logged} logged steps of one model "
            f"each: --checkpoint-every{', and the open round' if bodies else ''}), but its "
            f"disk has {free / 2**30:.1f} GiB free: free "
            "some, give another --state-dir, or a smaller --checkpoint-every",
            model_bytes=model,
            needed_bytes=needed,
            free_bytes=free,
        )

    def _registration(self, worker_id: str, waits_for_initial: bool = False) -> dict:
        has_weights = self.model.masters is not None
        needs = not has_weights and (not waits_for_initial or self._claims_upload(worker_id))
        return {
            "worker_id": worker_id,
            "round": self.model.version,
            "fragment_rounds": self.engine.fragment_rounds(),
            "needs_initial_weights": needs,
            "initial_upload_by": None if has_weights else self._uploader,
            "model_fingerprint": self.model.fingerprint if has_weights else None,
            "settings": self.settings.to_wire(),
        }

    def _claims_upload(self, worker_id: str) -> bool:
        """Whether `worker_id` (which waits for another's weights) is the one to upload the
        initial weights: the first such registrant, until it leaves the run; then the next
        to ask (a waiting worker asks again by registering again under its session)."""
        holder = self._uploader
        if holder is None or holder == worker_id or self.membership.get_live(holder) is None:
            self._uploader = worker_id
            return True
        return False

    def deregister(self, worker_id: str) -> None:
        self.membership.require_live(worker_id)
        log.info("worker %s left at round %d", worker_id, self.model.version)
        self.remove(worker_id, "deregistered")

    def evict_stale(self) -> list[str]:
        """Evict workers silent past the heartbeat timeout, and members a barrier has waited
        on past --barrier-timeout (heartbeats but no submission); the barrier re-checks.
        Not on a follower shard, which evicts nobody: membership is shard 0's."""
        if self.role.follows:
            return []
        stale = self.membership.stale(self.clock(), self.settings.heartbeat_timeout)
        for worker_id in stale:
            log.warning(
                "worker %s evicted: silent for more than %g s",
                worker_id,
                self.settings.heartbeat_timeout,
            )
            self.remove(worker_id, "evicted")
            self.metrics.evictions.inc()
        now = self.clock()
        overdue = self.engine.overdue(now)
        for worker_id in overdue:
            log.warning(
                "worker %s evicted: its heartbeats go on, but it has not submitted within "
                "the barrier timeout of %g s (a hung training loop?); the round goes on "
                "without it, and it registers again if it comes back",
                worker_id,
                self.settings.effective_barrier_timeout,
            )
            self.remove(worker_id, "barrier_timeout")
            self.metrics.evictions.inc()
        return stale + overdue

    def remove(
        self, worker_id: str, event: str, *, rounds_go_on: bool = True, **detail: object
    ) -> None:
        """Membership ends (audited as `event`, with `detail`); the open rounds go on
        (`rounds_go_on` False: the caller calls `rounds_go_on_without` once its own
        transaction has committed, so that a round this completes commits in one of its own)."""
        self.membership.depart(worker_id)
        keep = self.engine.units_of(worker_id)
        self.journal.worker_left(worker_id, self.model.version, event, keep_units=keep, **detail)
        self.metrics.live_workers.set(len(self.membership.live_ids()))
        if rounds_go_on:
            self.rounds_go_on_without(worker_id)

    def rounds_go_on_without(self, worker_id: str) -> None:
        """The open rounds stop waiting for a departed worker (one may commit now)."""
        self.engine.on_leave(worker_id, self.clock())
