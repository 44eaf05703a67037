"""The authority of a DiLoCo run: who trains, the global model, and when it steps.

No HTTP here: the app translates requests into these calls and `Rejection`s into responses, and
tests drive the coordinator by calling its methods. Every method takes the one lock (heartbeats
take only the registry's own); a method that refuses raises `Rejection` before it changes
anything.

The coordinator composes classes with one job each: `Membership` (who is live, DyLU advice),
`GlobalModel` (masters, outer optimizer, version, the durable step), `Intake` (admit, scan,
fold a submission), `DataLeases` (datasets and leases) and the mode's round engine
(`BarrierRounds` or `AsyncArrivals`), which decides when pseudo-gradients combine into a step
and sees the run only through an `EngineContext`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from diloco import faults
from diloco.algorithm import RunningMean
from diloco.server.errors import Rejection, rejection_of
from diloco.server.members.membership import Membership
from diloco.server.members.registrar import Registrar
from diloco.server.model.downloads import ResultDownloads
from diloco.server.model.global_model import GlobalModel, specs_of
from diloco.server.model.results import RoundResult, Waiting
from diloco.server.model.sent_rounds import SentRounds
from diloco.server.ops.admin import AdminActions
from diloco.server.ops.control import RunControl
from diloco.server.ops.metrics import ServerMetrics, Traffic
from diloco.server.ops.tensorboard import TensorBoardScalars
from diloco.server.rounds.admission import Intake, record_folded
from diloco.server.rounds.engine import EngineContext, ShardEngine
from diloco.server.rounds.engines import engine_for
from diloco.server.rounds.robust import RobustScreen
from diloco.server.rounds.round import Round
from diloco.server.settings import ServerSettings
from diloco.server.shards.commit import ShardCommit
from diloco.server.shards.peers import ShardPeers
from diloco.server.shards.role import ShardRole
from diloco.server.state.held_slices import HeldSlices
from diloco.server.state.journal import CommitRecord, LoggedStep, RoundJournal
from diloco.server.state.step_inputs import InputCopy, StepInputs, discard_all, logs_bodies
from diloco.server.state.store import HELD_SLICES_NAME, STEP_INPUTS_NAME, StateStore
from diloco.server.workunits.leases import DataLeases
from diloco.wire import (
    PROTOCOL_VERSION,
    SpooledTensors,
    SpoolFollower,
    TensorSpec,
    WireError,
    check_tensors,
)

__all__ = ["Coordinator", "RoundResult", "Waiting"]

MAX_WAIT_SECONDS = 120.0
log = logging.getLogger("diloco.server")


class Coordinator:
    """One run's global state; the mode's round engine decides when an outer step happens."""

    def __init__(
        self,
        settings: ServerSettings,
        initial: Mapping[str, torch.Tensor] | None = None,
        *,
        metrics: ServerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        journal: RoundJournal | None = None,
        scalars: TensorBoardScalars | None = None,
        peers: ShardPeers | None = None,
    ) -> None:
        """`scalars`: --tensorboard's writer, given each commit's metrics (None: no file);
        `peers`: the other shards of a sharded run (server/shards/peers.py)."""
        self.settings = settings
        self.scalars = scalars
        self.metrics = metrics or ServerMetrics()
        self.clock = clock
        self.started_at = clock()
        self._lock = threading.Condition()
        # Without a state dir the same journal keeps its tables in memory and writes no files.
        self.journal = journal or RoundJournal(StateStore(None), settings)
        # One server logs each step and checkpoints it in the background; sharded servers
        # decide their commits across shards and checkpoint before answering.
        self.journal.log_steps = settings.shards == 1
        self.journal.on_checkpoint_written = self._checkpoint_written
        self.journal.on_checkpoint_failed = self._checkpoint_failed
        # the results the HTTP layer has sent each worker: in sync mode, where a step's
        # contributors are who fetch its result next, its background checkpoint starts once
        # they have (model/downloads.py); in streaming and async mode at once
        self.result_downloads = ResultDownloads()
        if settings.mode == "sync":
            self.journal.downloads = self.result_downloads
        # Before the model: an outer lr an admin set is the optimizer's from the start.
        self.control = RunControl(
            self.journal.state,
            settings,
            clock,
            command_line_wins=self.journal.override_settings,
        )
        self.model = GlobalModel(settings)
        self.model.fixed_plan = self.journal.state.get_meta("fragment_plan")  # streaming shards
        self.membership = Membership()
        self.traffic = Traffic(self.metrics)
        self.rounds_committed = 0
        self.closing = False
        self.pool = self.journal.pool
        self.data_leases = DataLeases(self.pool, self.journal.state)
        self.last_commit: CommitRecord | None = None
        self.screen = RobustScreen(settings.robust, settings.fragments)
        # one server, shard 0 or another shard: given to whoever behaves differently by role
        self.role = ShardRole(settings, peers)
        context = EngineContext(
            settings=settings,
            clock=clock,
            model=self.model,
            membership=self.membership,
            metrics=self.metrics,
            data_leases=self.data_leases,
            applied_version=self.journal.state.applied_version,
            record_folded=functools.partial(record_folded, self.traffic),
            commit=self._commit_step,
            publish=self._published,
            closing=lambda: self.closing,
            paused=lambda: self.control.paused,
            screen=self.screen,
        )
        self.engine: ShardEngine = engine_for(context, self.role)
        # A sync or async follower shard makes each slice it holds durable: a restart takes
        # them back, so a decision never waits on a worker that died (state/held_slices.py).
        self.held_slices: HeldSlices | None = None
        directory = self.journal.state.directory
        if directory is not None and self.role.follows and self.role.decides:
            self.held_slices = HeldSlices(directory / HELD_SLICES_NAME)
        # One server logging its steps makes each body durable as it comes (not the sums at
        # the commit) where a step is a plain mean of bodies folded as they come.
        self.step_inputs: StepInputs | None = None
        steps = self.journal.state.steps
        if steps is not None and logs_bodies(settings, self.journal.logs_steps):
            assert directory is not None
            self.step_inputs = StepInputs.beside(directory / STEP_INPUTS_NAME, steps)
        self.intake = Intake(
            self._lock,
            settings,
            self.model,
            self.membership,
            self.engine,
            self.traffic,
            lambda: self.closing,
            self.held_slices,
            self.step_inputs,
        )
        self.registrar = Registrar(
            settings,
            clock,
            self.model,
            self.membership,
            self.journal,
            self.engine,
            self.metrics,
            self.role,
            is_banned=self.control.is_banned,
        )
        # Sharded servers: confirmations and decisions across shards (None: one server).
        self.shard: ShardCommit | None = None
        if not self.role.single:
            self.shard = ShardCommit(
                self._lock,
                self.engine,
                self.role,
                self.membership,
                self.journal,
                clock,
                self.model.require_healthy,
                self.registrar.remove,
                lambda: self.closing,
                lambda: self.control.paused,
                lambda paused: self.admin.follow_pause(paused),
                lambda: self.control.pause_stamp,
            )
        self.admin = AdminActions(
            self._lock,
            self.control,
            self.model,
            self.membership,
            self.registrar,
            self.engine,
            self.journal.state,
            self.metrics,
            clock,
            self.role,
        )
        self.sent_rounds = SentRounds()  # delta downloads after a rollback
        self._restore(initial)

    def _restore(self, initial: Mapping[str, torch.Tensor] | None) -> None:
        """Resume from the state dir, or start from `initial` (--init), or wait for weights."""
        restored = self.journal.restore()
        if restored is not None:
            if initial is not None:
                raise ValueError(
                    f"the state dir already holds round {restored.round}; drop --init to resume"
                )
            self.model.set_specs(restored.specs, kinds_known=True)
            self.model.adopt(restored.masters, restored.round, restored.published)
            self.model.optimizer.load_state_dict(restored.optimizer_state)
            fragment_rounds = restored.fragment_rounds
            for step in restored.pending:
                self._replay(step, last=step is restored.pending[-1])
                fragment_rounds = step.fragment_rounds
            self.screen.restore(restored.norm_history or [])
            # The workers live at the crash are members again: the restored round waits for
            # them (a missing one is evicted after the heartbeat timeout, as always), so a
            # lone early resubmission cannot commit a round that others were part of.
            self._readmit(restored.live_workers)
            self.engine.start(fragment_rounds, self.started_at)
            self._take_back_held()
            self.metrics.round.set(self.model.version)
            # workers may hold rounds this restart forgot: interval durability, or a step log
            # cut short (a step missing or corrupt)
            self.sent_rounds.rollback_possible = (
                self.journal.durability == "interval" or restored.rolled_back
            )
        elif initial is not None:
            self._adopt_weights(initial, kinds=None)
        else:
            # A run that crashed before it had weights: its registered workers still hold
            # their ids, and the first of them may be uploading the initial weights.
            known = self.journal.registered_specs()
            if known is not None:
                self.model.set_specs(known, kinds_known=True)
                self._readmit(self.journal.state.live_workers())

    def _take_back_held(self) -> None:
        """A follower's slices (sync: of its open round), held durably before it stopped, are
        held again (in the order they came, each under the session it came from); the rest
        go: slices of committed rounds, and any that cannot be read back whole or that the
        round refuses, whose worker is asked for it again (409 `not_submitted`)."""
        store = self.held_slices
        if store is None:
            return
        if self.settings.mode == "sync":  # (async: a slice of an older anchor may be decided)
            store.forget_before(self.model.version)
        slices, problems = store.stored()
        for problem in problems:
            log.warning("a held slice in the state dir was unreadable and is dropped: %s", problem)
        taken = 0
        for stored in slices:
            answer: dict = {}
            try:
                body = store.open(stored)
            except (OSError, ValueError, WireError) as exc:
                log.warning("held slice %s is dropped: %s", stored.body.name, exc)
            else:
                try:
                    answer = self.intake.take_back(stored, body, self.clock())
                except (Rejection, WireError, OSError, ValueError) as exc:
                    worker, number = stored.worker_id, stored.round
                    log.warning("%r's held slice of round %d is dropped: %s", worker, number, exc)
                finally:
                    body.close()  # unless the round holds it
            if answer.get("status") == "accepted":
                taken += 1
            else:  # unreadable, refused, or a duplicate the round holds already
                store.forget(stored)
        if taken:
            number = self.model.version
            log.warning("%d held slice(s) of round %d taken back from the state dir", taken, number)

    def _replay(self, step: LoggedStep, last: bool) -> None:
        """A step the newest checkpoint does not hold (logged since, or caught between its
        log and its checkpoint): applied again from the log (its sums, through the same
        commit, at the lr it used), so the weights, the momentum and the published copy are
        the ones the workers saw; after the `last` of them their checkpoint is written,
        before anything is served."""
        model = self.model
        optimizer = model.optimizer
        lr, optimizer.lr = optimizer.lr, step.lr
        try:
            running = step.running if step.running is not None else self.intake.refold(step)
            model.commit(
                running,
                step.record.round + 1,
                lambda: (
                    self.journal.write_replayed(
                        step,
                        model.masters,
                        model.optimizer.state_dict(copy=False),
                        model.specs,
                        model.published_tensors,
                    )
                    if last
                    else None
                ),
                step.names,
            )
        except Exception as exc:
            raise ValueError(
                f"the step log's outer step {step.record.round} cannot be applied again ({exc}); "
                f"move the state dir's steps/gen-{step.record.round:012d} and every later "
                "generation aside to resume before it, losing those steps"
            ) from exc
        finally:
            optimizer.lr = lr
        self.last_commit = step.record
        log.warning(
            "outer step %d (round %d -> %d) replayed from the step log: no checkpoint held it "
            "when the server stopped",
            step.record.round,
            step.record.round,
            model.version,
        )

    def _checkpoint_written(self, seconds: float) -> None:
        """A background checkpoint is durable (its thread): the metrics see its time."""
        self.metrics.round_part_seconds.labels(part="checkpoint").observe(seconds)

    def _checkpoint_failed(self, why: str) -> None:
        """A background checkpoint failed (its thread): serve nothing more until a restart,
        which replays the step from its log. Assigning a string needs no lock."""
        self.model.broken = why

    def _readmit(self, workers: Sequence[tuple[str, str | None]]) -> None:
        self.membership.restored_counts = {
            row["worker_id"]: row["rounds_contributed"] for row in self.journal.state.workers()
        }
        for worker_id, session in workers:
            if not self.control.is_banned(worker_id):
                self.membership.admit(worker_id, self.started_at, session)
        self.metrics.live_workers.set(len(self.membership.live_ids()))

    # ----------------------------------------------------------------- read-only views

    @property
    def masters(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights (int/bool buffers keep their dtype); None before any."""
        return self.model.masters

    @property
    def version(self) -> int:
        """The version: outer steps committed (the round in sync mode)."""
        return self.model.version

    round_number = version

    @property
    def plan(self) -> list[list[str]] | None:
        return self.model.plan

    @property
    def round(self) -> Round | None:
        """The open round (sync), fragment 0's open round (streaming), or the grace window."""
        return self.engine.open_round()

    def info(self) -> dict:
        with self._lock:
            self.model.require_healthy()  # its round would name state a restart may not have
            has_weights = self.model.masters is not None
            return {
                "protocol_version": PROTOCOL_VERSION,
                "mode": self.settings.mode,
                "round": self.model.version,
                "fragment_rounds": self.engine.fragment_rounds(),
                "fragment_plan": self.model.plan if has_weights else None,
                "model_fingerprint": self.model.fingerprint if has_weights else None,
                "settings": self.settings.to_wire(),
                # sharded servers only: where every part of the model lives
                **({} if self.shard is None else {"shards": self.shard.info(self.model.specs)}),
            }

    def status(self) -> dict:
        with self._lock:
            now = self.clock()
            uptime = max(1e-9, now - self.started_at)
            recommended = self._dylu_advice()  # once for every worker
            workers = []
            for record in self.membership.records():
                entry = record.to_status(now)
                entry["recommended_sync_every"] = recommended.get(record.worker_id)
                workers.append(entry)
            return {
                "round": self.model.version,
                "mode": self.settings.mode,
                "broken": self.model.broken,  # why it refuses everything else, until restarted
                "fragment_rounds": self.engine.fragment_rounds(),
                "workers": workers,
                "waiting_for": self.engine.waiting_for(),
                "more_submissions_needed": self.engine.more_submissions_needed(),
                "bytes_in": self.traffic.bytes_in,
                "bytes_out": self.traffic.bytes_out,
                "rounds_per_hour": self.rounds_committed / uptime * 3600.0,
                "datasets": self.data_leases.progress(),
                "uptime_seconds": uptime,
                **self.admin.state_of(),  # paused, outer_lr, banned
            }

    # ----------------------------------------------------------------- membership

    def register(
        self,
        worker_id: str | None,
        specs: Sequence[TensorSpec],
        protocol_version: int,
        session: str | None = None,
        waits_for_initial: bool = False,
    ) -> dict:
        """Admit a worker (see `Registrar.register`)."""
        with self._lock:
            return self.registrar.register(
                worker_id, specs, protocol_version, session, waits_for_initial
            )

    def deregister(self, worker_id: str) -> None:
        with self._lock:
            self.registrar.deregister(worker_id)

    def evict_stale(self) -> list[str]:
        """Evict the silent and the overdue (see `Registrar.evict_stale`); then the engine's
        timed work (an async grace window's deadline)."""
        with self._lock:
            evicted = self.registrar.evict_stale()  # (none on a follower shard)
            self.engine.tick(self.clock())
            return evicted

    def heartbeat(
        self,
        worker_id: str,
        step: int,
        steps_per_second: float,
        loss: float | None,
        tokens: int,
        windows: int | None = None,
    ) -> dict:
        """A sign of life with progress; `windows` counts the worker's finished sync windows,
        and a new count makes `steps_per_second` (that window's compute speed) a DyLU sample.

        Only the registry's own lock: a commit holding the coordinator's for a slow checkpoint
        write must not hold back the heartbeats (they would all be late at once)."""
        record = self.membership.beat(
            worker_id, self.clock(), step, steps_per_second, loss, tokens, windows
        )
        if record is None:
            self.membership.require_live(worker_id)  # raises the 404
        faults.crash_point("heartbeat")
        return {
            "round": self.model.version,
            "recommended_sync_every": self._dylu_advice().get(worker_id),
            "command": None,
        }

    def _dylu_advice(self) -> dict[str, int]:
        """Each live worker's H under DyLU (none without --dylu)."""
        if not self.settings.dylu:
            return {}
        return self.membership.dylu_advice(self.settings.sync_every)

    def _require_usable(self, worker_id: str) -> None:
        """Healthy, and `worker_id` live (its sign of life counts)."""
        self.model.require_healthy()
        self.membership.require_live(worker_id).last_seen = self.clock()

    # ----------------------------------------------------------------- work units

    def register_dataset(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict:
        """A worker states its dataset; the same id with another shape is a 409."""
        with self._lock:
            self._require_usable(worker_id)
            if self.shard is not None:
                self.shard.require_datasets()
            return self.data_leases.register(worker_id, dataset_id, length, shuffle_seed, unit_size)

    def lease_units(
        self,
        worker_id: str,
        dataset_id: str,
        count: int,
        next_epoch: bool = False,
        lease_key: str | None = None,
    ) -> dict:
        """Hand out work units; each belongs to `worker_id` until completed or released."""
        with self._lock:
            self._require_usable(worker_id)
            return self.data_leases.lease(worker_id, dataset_id, count, next_epoch, lease_key)

    def leases_of(self, worker_id: str, dataset_id: str) -> dict:
        """The units of a dataset leased to a live worker, with the samples still to train."""
        with self._lock:
            self._require_usable(worker_id)
            return self.data_leases.leases_of(worker_id, dataset_id)

    def data_progress(self) -> list[dict]:
        with self._lock:
            return self.data_leases.progress()

    # ----------------------------------------------------------------- weights

    def _adopt_weights(
        self, tensors: Mapping[str, torch.Tensor], kinds: Mapping[str, str] | None
    ) -> None:
        if self.model.specs is None:
            self.model.set_specs(specs_of(tensors, kinds), kinds_known=kinds is not None)
        self.model.adopt(tensors)
        model = self.model
        assert model.masters is not None and model.specs is not None
        model.durably(
            "writing the initial weights",
            lambda: self.journal.save_initial(
                model.masters,
                model.optimizer.state_dict(copy=False),
                model.specs,
                [0] * self.settings.fragments,
                published=model.published_tensors,
            ),
        )
        self.engine.start([0] * self.settings.fragments, self.clock())

    def upload_initial(self, worker_id: str, tensors: Mapping[str, torch.Tensor]) -> int:
        """The first registered worker's state becomes the global weights (first upload wins)."""
        with self._lock:
            self.membership.require_live(worker_id)
            if self.model.masters is not None:
                raise Rejection(
                    409,
                    "weights_exist",
                    "the global weights already exist; fetch /v1/weights",
                    current_round=self.model.version,
                    initial_from=self.journal.state.get_meta("initial_from"),
                )
            specs = self.model.specs
            assert specs is not None  # a live worker registered its specs
            try:
                check_tensors(tensors, specs, float_dtype=None)
            except WireError as error:
                raise rejection_of(error) from None
            # Whose they are, first (a crash between leaves it for the next upload to
            # overwrite): sharded servers' other shards take theirs from that worker only.
            self.journal.state.set_meta("initial_from", worker_id)
            self._adopt_weights(tensors, {n: s.kind for n, s in specs.items()})
            self.traffic.received(sum(t.numel() * t.element_size() for t in tensors.values()))
            return self.model.version

    def weights(self, version: int | None = None) -> RoundResult:
        """The current global weights, encoded once per version in the download dtype; or
        exactly `version` (async shards: see `ShardCommit.weights_at`)."""
        with self._lock:
            self.model.require_healthy()  # the masters may hold a step that is not durable
            if self.model.masters is None:
                raise Rejection(
                    404,
                    "no_weights",
                    "the global weights do not exist yet; "
                    "the first worker to register uploads them",
                )
            if version is None:
                result = self.model.current_weights(self.engine.fragment_rounds()).lend()
            else:
                result = ShardCommit.weights_at(self.shard, version)
            self.traffic.sent(len(result.body))
            return result

    # ----------------------------------------------------------------- rounds

    def submit(
        self,
        worker_id: str,
        round_number: int,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        *,
        fragment: int = 0,
        tokens: int = 0,
        units: Sequence[int] = (),
        progress: Mapping[int, int] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> dict:
        """Fold one pseudo-gradient in (see `Intake.submit`)."""
        return self.intake.submit(
            worker_id,
            round_number,
            tensors,
            fragment=fragment,
            tokens=tokens,
            units=units,
            progress=progress,
            metadata=metadata,
        )

    def check_header(
        self,
        fragment: int,
        shapes: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """A submission's layout from its header alone (see `Intake.check_header`)."""
        self.intake.check_header(fragment, shapes, metadata or {})

    def max_header_bytes(self, fragment: int | None) -> int | None:
        """The longest safetensors header a body of `fragment`'s tensors (None: every tensor
        this server holds, the initial weights) may have; None before the model's specs are
        known, or for a fragment outside the plan or without tensors here (another shard's:
        the body's own checks then give the reason, 409 wrong_shard)."""
        model = self.model
        if fragment is None:
            return model.header_limit
        limits = model.fragment_header_limits
        return limits[fragment] if 0 <= fragment < len(limits) else None

    @property
    def copies_uploads(self) -> bool:
        """Whether uploads may be copied into the state dir for the step log (one server
        logging its steps: state/step_inputs.py); `follow_upload` is for those only."""
        return self.intake.step_inputs is not None

    def follow_upload(
        self, fragment: int, source: int, nbytes: int, size: int
    ) -> SpoolFollower | None:
        """A copy of a submission's body for the step log, begun as it is spooled (see
        `Intake.follow`): the spool's `SpoolFollower`, or None."""
        return self.intake.follow(fragment, source, nbytes, size)

    def _commit_step(
        self,
        running: RunningMean,
        record: CommitRecord,
        fragment_rounds: Sequence[int],
        inputs: list[InputCopy] | None,
    ) -> None:
        """Apply one outer step's pseudo-gradients and make it durable (lock held).

        The journal writes before any worker can see the result (durability "round"); the
        version then counts the step. The engine publishes the result afterwards. `inputs`:
        the round's bodies, already in the state dir (step_inputs.py), which the step's log
        then holds instead of its sums; None (or none) logs the sums.
        """
        started = time.perf_counter()
        model = self.model
        live = len(self.membership.live_ids())
        assert model.plan is not None
        names = model.plan[record.fragment] if len(model.plan) > 1 else None
        metrics = {
            "live_workers": live,
            "contributions": len(record.contributors),
            "bytes_in": self.traffic.bytes_in,
            "bytes_out": self.traffic.bytes_out,
            "workers": self.membership.snapshot(self.clock()),
        }
        if running.senders is not None:  # sparse_mean: the means over senders, then logged
            assert model.specs is not None  # the trained tensors (buffers: the plain mean)
            running.divide_by_senders(name for name, spec in model.specs.items() if spec.trained)
        journal = self.journal
        log_step = None
        if journal.logs_steps:
            # the last step's checkpoint first: the step below moves what it reads
            model.durably("writing the checkpoint of the last round", journal.settle)
            self.metrics.round_part_seconds.labels(part="checkpoint_wait").observe(
                time.perf_counter() - started
            )
            optimizer_lr = model.optimizer.lr

            if inputs and any(copy.failed for copy in inputs):
                log.warning(
                    "a body of round %d could not be made durable in the state dir; the step "
                    "logs its sums instead",
                    record.round,
                )
                discard_all(inputs)
                inputs = None
            logged_inputs = inputs or ()

            def log_step() -> Callable[[], None]:
                return journal.log_step(
                    record, running, names, fragment_rounds, optimizer_lr, logged_inputs
                )

        model.commit(
            running,
            record.round + 1,
            lambda: journal.commit(
                record,
                model.masters,
                model.optimizer.state_dict(copy=False),
                model.specs,
                metrics,
                list(fragment_rounds),
                published=model.published_tensors,
                started=started,
            ),
            names,
            log_step,
        )
        for part, seconds in model.step_seconds.items():
            self.metrics.round_part_seconds.labels(part=part).observe(seconds)
        if self.scalars is not None:
            self.scalars.commit(record.round, metrics, time.perf_counter() - started)
        self.last_commit = record
        self.metrics.screened.labels(outcome="refused").inc(len(record.refused))
        self.metrics.screened.labels(outcome="clipped").inc(len(record.clipped))
        self.rounds_committed += 1
        self.metrics.rounds.inc()
        self.metrics.round.set(model.version)
        self.metrics.outer_step_seconds.observe(time.perf_counter() - started)

    def _published(self, description: str, started: float) -> None:
        """After a step's result is out: log it and wake every long-poll (lock held)."""
        seconds = time.perf_counter() - started
        self.metrics.round_part_seconds.labels(part="commit").observe(seconds)
        log.info(
            "%s committed (version %d), outer step and encoding %.3f s",
            description,
            self.model.version,
            seconds,
        )
        self._lock.notify_all()
        faults.crash_point("result_published")

    def wait_result(
        self,
        round_number: int,
        worker_id: str | None,
        wait: float,
        fragment: int = 0,
        have: int | None = None,
        version: int | None = None,
    ) -> RoundResult | Waiting:
        """Long-poll for a round's result: the new weights, or Waiting when `wait` runs out.

        `have` is the round (version) of the caller's anchor: with --download-codec, a caller
        at the round the step started from gets the step's coded delta instead. `version`:
        exactly those weights (async shards: see `ShardCommit.poll_version`)."""
        poll = self.engine.poll_result
        if version is not None:
            poll = ShardCommit.poll_version(self.shard, version)
        wait = min(max(0.0, wait), MAX_WAIT_SECONDS)
        with self._lock:
            self.model.require_healthy()
            if worker_id is not None:
                self.membership.require_live(worker_id)
            self.intake.require_round_and_fragment(round_number, fragment)
            deadline = self.clock() + wait
            while True:
                # again after every wake: a commit that failed meanwhile may have left bodies
                # half moved (P, a delta written over) that no result may lend
                self.model.require_healthy()
                outcome = poll(round_number, fragment, worker_id, self.clock())
                if outcome is not None:
                    if isinstance(outcome, RoundResult):
                        vouched = self.sent_rounds.vouched(worker_id, fragment, have)
                        outcome = outcome.for_anchor(vouched)
                        self.traffic.sent(len(outcome.body))
                        self.sent_rounds.sent(worker_id, fragment, outcome.round)
                    return outcome
                now = self.clock()
                remaining = deadline - now
                if remaining <= 0 or self.closing:
                    return self.engine.waiting(round_number, fragment)
                self._lock.wait(timeout=min(remaining, self.engine.wake_within(now)))

    # ----------------------------------------------------------------- the end

    def close(self) -> None:
        """Stop taking submissions and release every long-poll at once (they answer "waiting").

        Open barriers are abandoned: their contributions are not applied, and their workers,
        told after the restart that their submission is missing, send it again.
        """
        with self._lock:
            self.closing = True
            self._lock.notify_all()

    def shutdown(self) -> bool:
        """After the HTTP server has drained: flush what the disk lacks, then close the store.

        Returns whether a checkpoint had to be written now: the newest one was older than
        the current round (either durability mode; RoundJournal.flush).
        """
        with self._lock:
            self.closing = True
            flushed = False
            model = self.model
            try:
                if model.masters is not None and model.specs is not None and model.broken is None:
                    flushed = self.journal.flush(
                        model.version,
                        model.masters,
                        model.optimizer.state_dict(copy=False),
                        model.specs,
                        self.last_commit,
                        self.engine.fragment_rounds(),
                        published=model.published_tensors,
                    )
            finally:
                self.journal.close()
                if self.scalars is not None:
                    self.scalars.close()
            return flushed
