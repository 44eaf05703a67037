"""The authority of a DiLoCo run: membership, the global weights, and the outer steps.

No HTTP here: the app translates requests into these calls and `Rejection`s into responses, and
tests drive the coordinator by calling its methods. Every method takes the one lock; a method
that refuses raises `Rejection` before it changes anything.

When pseudo-gradients are combined is the job of a round engine (`server.engines`): barriers
per round or per streaming fragment (`BarrierRounds`), or arrivals applied at once with an
optional grace window (`AsyncArrivals`). The coordinator owns what they share: the fp32
masters, the outer optimizer, the version (outer steps committed), the durable commit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch

from diloco import faults
from diloco.algorithm import (
    RunningMean,
    TensorKind,
    apply_running_mean,
    block_prefixes_from_names,
    dylu_local_steps,
    plan_fragments,
)
from diloco.algorithm.tensors import finite_bound
from diloco.server.engines import AsyncArrivals, BarrierRounds, RoundEngine
from diloco.server.errors import Rejection
from diloco.server.journal import CommitRecord, RoundJournal
from diloco.server.master_frames import MasterFrames
from diloco.server.membership import Membership
from diloco.server.metrics import ServerMetrics
from diloco.server.results import Published, RoundResult, Waiting
from diloco.server.rounds import Round, ValueScan
from diloco.server.settings import ServerSettings
from diloco.server.store import StateStore
from diloco.server.submission import Submission
from diloco.wire import (
    MAX_COUNT,
    PROTOCOL_VERSION,
    WORKER_ID_PATTERN,
    SpooledTensors,
    TensorSpec,
    WireError,
    check_finite,
    check_tensors,
    encode_tensors,
    fingerprint,
    first_difference,
    is_worker_id,
)
from diloco.wire.spool import CheckedPieces

__all__ = ["Coordinator", "RoundResult", "Waiting"]

MAX_WAIT_SECONDS = 120.0
# DyLU never gives a worker fewer than about H / 16 steps, whatever speed another one claims
# (algorithm/dylu.py): honest speeds within 16x of each other are unaffected.
DYLU_MAX_SPEED_RATIO = 16.0
log = logging.getLogger("diloco.server")


def rejection_of(error: WireError) -> Rejection:
    return Rejection(error.status, error.kind, error.error, **error.detail)


def scan_values(tensors: Mapping[str, torch.Tensor] | SpooledTensors) -> ValueScan:
    """Rejection (422) for NaN or Inf; else a bound of the values' magnitude and the tensor
    that sets it, which lets a round refuse what could overflow its sums and know them
    finite without scanning them again."""
    try:
        if isinstance(tensors, SpooledTensors):
            bound = tensors.check_values()
            return ValueScan(bound, tensors.largest)
        scan = ValueScan(0.0)
        for name, tensor in tensors.items():
            bound = finite_bound(tensor)
            if bound is None:
                check_finite(name, tensor)  # raises, naming the tensor and the count
                bound = math.inf
            if bound > scan.bound or scan.largest is None:
                scan = ValueScan(max(bound, scan.bound), name)
        return scan
    except WireError as error:
        raise rejection_of(error) from None


def fragment_plan(specs: Sequence[TensorSpec], fragments: int) -> list[list[str]]:
    """Which tensor names each fragment holds: strided over the model's blocks when its names
    show them (as `diloco simulate` plans from the module), else contiguous by parameter count.
    """
    sizes = [(spec.name, math.prod(spec.shape)) for spec in specs]
    if fragments == 1:
        return [[name for name, _ in sizes]]
    prefixes = block_prefixes_from_names([name for name, _ in sizes])
    return plan_fragments(sizes, fragments, prefixes or None)


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
    ) -> None:
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.clock = clock
        self.started_at = clock()
        self._lock = threading.Condition()
        self.optimizer = settings.make_outer_optimizer()
        self.membership = Membership()
        self.frames: MasterFrames | None = None  # the masters, in the result's byte layout
        self.specs: dict[str, TensorSpec] | None = None
        self.plan: list[list[str]] | None = None  # names per fragment (one fragment but streaming)
        self.owner: dict[str, int] = {}  # name -> its fragment (from the plan)
        self.kinds_known = False
        self.version = 0  # outer steps committed: the round in sync mode
        self.result: Published | None = None  # the current full weights, encoded once
        self.bytes_in = 0
        self.bytes_out = 0
        self.rounds_committed = 0
        self.closing = False
        # Without a state dir the same journal keeps its tables in memory and writes no files.
        self.journal = journal or RoundJournal(StateStore(None), settings)
        self.pool = self.journal.pool
        self.last_commit: CommitRecord | None = None
        self.broken: str | None = None
        self.engine: RoundEngine = (
            AsyncArrivals(self) if settings.mode == "async" else BarrierRounds(self)
        )
        restored = self.journal.restore()
        if restored is not None:
            if initial is not None:
                raise ValueError(
                    f"the state dir already holds round {restored.round}; drop --init to resume"
                )
            self._set_specs(restored.specs, kinds_known=True)
            self.frames = self._frames_of(restored.masters)
            self.optimizer.load_state_dict(restored.optimizer_state)
            self.version = restored.round
            # The workers live at the crash are members again: the restored round waits for
            # them (a missing one is evicted after the heartbeat timeout, as always), so a
            # lone early resubmission cannot commit a round that others were part of.
            for worker_id, session in restored.live_workers:
                self.membership.admit(worker_id, self.started_at, session)
            self.engine.start(restored.fragment_rounds, self.started_at)
            self.metrics.live_workers.set(len(self.membership.live_ids()))
            self.metrics.round.set(self.version)
        elif initial is not None:
            self._adopt_weights(initial, kinds=None)
        else:
            # A run that crashed before it had weights: its registered workers still hold
            # their ids, and the first of them may be uploading the initial weights.
            known = self.journal.registered_specs()
            if known is not None:
                self._set_specs(known, kinds_known=True)
                for worker_id, session in self.journal.state.live_workers():
                    self.membership.admit(worker_id, self.started_at, session)
                self.metrics.live_workers.set(len(self.membership.live_ids()))

    # ----------------------------------------------------------------- read-only views

    @property
    def masters(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights (int/bool buffers keep their dtype); None before any.

        Read them here; an update goes through `frames.writable()` (see MasterFrames)."""
        return None if self.frames is None else self.frames.masters

    @property
    def round_number(self) -> int:
        """The version: outer steps committed (the round in sync mode)."""
        return self.version

    @property
    def round(self) -> Round | None:
        """The open round (sync), fragment 0's open round (streaming), or the grace window."""
        return self.engine.open_round()

    @property
    def model_fingerprint(self) -> str | None:
        return None if self.specs is None else fingerprint(list(self.specs.values()))

    def info(self) -> dict:
        with self._lock:
            self._require_healthy()  # its round would name state a restart may not have
            return {
                "protocol_version": PROTOCOL_VERSION,
                "mode": self.settings.mode,
                "round": self.version,
                "fragment_rounds": self.engine.fragment_rounds(),
                "fragment_plan": self.plan if self.masters is not None else None,
                "model_fingerprint": self.model_fingerprint if self.masters is not None else None,
                "settings": self.settings.to_wire(),
            }

    def status(self) -> dict:
        with self._lock:
            now = self.clock()
            uptime = max(1e-9, now - self.started_at)
            recommended = self._recommended_sync_everys()  # once for every worker
            workers = []
            for record in self.membership.records():
                entry = record.to_status(now)
                entry["recommended_sync_every"] = recommended.get(record.worker_id)
                workers.append(entry)
            return {
                "round": self.version,
                "mode": self.settings.mode,
                "broken": self.broken,  # why it refuses everything else, until restarted
                "fragment_rounds": self.engine.fragment_rounds(),
                "workers": workers,
                "waiting_for": self.engine.waiting_for(),
                "more_submissions_needed": self.engine.more_submissions_needed(),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "rounds_per_hour": self.rounds_committed / uptime * 3600.0,
                "datasets": self.pool.progress(),
                "uptime_seconds": uptime,
            }

    # ----------------------------------------------------------------- membership

    def register(
        self,
        worker_id: str | None,
        specs: Sequence[TensorSpec],
        protocol_version: int,
        session: str | None = None,
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
        with self._lock:
            self._require_healthy()
            now = self.clock()
            if self.specs is not None:
                difference = first_difference(list(self.specs.values()), list(specs))
                if difference is not None:
                    raise Rejection(
                        422,
                        "fingerprint_mismatch",
                        f"the model differs: {difference}",
                        expected=self.model_fingerprint,
                        got=fingerprint(list(specs)),
                    )
            worker_id = worker_id or f"w-{uuid.uuid4().hex[:8]}"
            holder = self.membership.get_live(worker_id)
            if holder is not None and session is not None and holder.session == session:
                holder.last_seen = now
                return self._registration(worker_id)
            if holder is not None:
                raise Rejection(
                    409,
                    "worker_id_taken",
                    f"worker id {worker_id!r} is held by a live worker",
                    worker_id=worker_id,
                )
            if self.specs is None or not self.kinds_known:
                try:
                    self._set_specs({s.name: s for s in specs}, kinds_known=True)
                except ValueError as exc:  # the model cannot be cut into the fragments asked
                    raise Rejection(
                        422,
                        "fragments_do_not_fit",
                        f"this model cannot be split as the server is configured: {exc}",
                        fragments=self.settings.fragments,
                    ) from None
                self.journal.save_registered_specs(self.specs)
            self.membership.admit(worker_id, now, session)
            self.journal.worker_joined(worker_id, session, self.version)
            faults.crash_point("registered")
            log.info("worker %s registered at round %d", worker_id, self.version)
            self.engine.on_register(worker_id)
            self.metrics.live_workers.set(len(self.membership.live_ids()))
            return self._registration(worker_id)

    def _set_specs(self, specs: dict[str, TensorSpec], *, kinds_known: bool) -> None:
        """The model's tensors; the fragment plan follows from them (ValueError if it cannot)."""
        plan = fragment_plan(list(specs.values()), self.settings.fragments)
        self.specs, self.plan, self.kinds_known = specs, plan, kinds_known
        self.owner = {name: f for f, members in enumerate(plan) for name in members}

    def _registration(self, worker_id: str) -> dict:
        return {
            "worker_id": worker_id,
            "round": self.version,
            "fragment_rounds": self.engine.fragment_rounds(),
            "needs_initial_weights": self.masters is None,
            "model_fingerprint": self.model_fingerprint if self.masters is not None else None,
            "settings": self.settings.to_wire(),
        }

    def deregister(self, worker_id: str) -> None:
        with self._lock:
            self._require_live(worker_id)
            log.info("worker %s left at round %d", worker_id, self.version)
            self._remove(worker_id, "deregistered")

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
        """
        # Only the registry's own lock: a commit holding the coordinator's for a slow
        # checkpoint write must not hold back the heartbeats (they would all be late at once).
        record = self.membership.beat(
            worker_id, self.clock(), step, steps_per_second, loss, tokens, windows
        )
        if record is None:
            self._require_live(worker_id)  # raises the 404
        faults.crash_point("heartbeat")
        return {
            "round": self.version,
            "recommended_sync_every": self._recommended_sync_every(worker_id),
            "command": None,
        }

    def _recommended_sync_every(self, worker_id: str) -> int | None:
        return self._recommended_sync_everys().get(worker_id)

    def _recommended_sync_everys(self) -> dict[str, int]:
        """DyLU: H_w = max(1, floor(v_w / max v * H)) over live workers' smoothed speeds, for
        each worker that has one (none without --dylu)."""
        if not self.settings.dylu:
            return {}
        return dylu_local_steps(
            self.membership.smoothed_speeds(), self.settings.sync_every, DYLU_MAX_SPEED_RATIO
        )

    def evict_stale(self) -> list[str]:
        """Evict workers silent past the heartbeat timeout, and members a barrier has waited
        on past --barrier-timeout (heartbeats but no submission); the barrier re-checks."""
        with self._lock:
            stale = self.membership.stale(self.clock(), self.settings.heartbeat_timeout)
            for worker_id in stale:
                log.warning(
                    "worker %s evicted: silent for more than %g s",
                    worker_id,
                    self.settings.heartbeat_timeout,
                )
                self._remove(worker_id, "evicted")
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
                self._remove(worker_id, "barrier_timeout")
                self.metrics.evictions.inc()
            self.engine.tick(now)
            return stale + overdue

    def _require_live(self, worker_id: str):
        record = self.membership.get_live(worker_id)
        if record is None:
            raise Rejection(
                404,
                "unknown_worker",
                f"worker {worker_id!r} is not registered (evicted or never registered); "
                "register again",
                worker_id=worker_id,
            )
        return record

    def _remove(self, worker_id: str, reason: str) -> None:
        self.membership.depart(worker_id)
        keep = self.engine.units_of(worker_id)
        self.journal.worker_left(worker_id, self.version, reason, keep_units=keep)
        self.metrics.live_workers.set(len(self.membership.live_ids()))
        self.engine.on_leave(worker_id, self.clock())

    # ----------------------------------------------------------------- work units

    def register_dataset(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict:
        """A worker states its dataset; the same id with another shape is a 409."""
        with self._lock:
            self._require_healthy()
            self._require_live(worker_id).last_seen = self.clock()
            with self.journal.state.transaction():
                known = dataset_id in self.pool.datasets()
                answer = self.pool.register(dataset_id, length, shuffle_seed, unit_size)
                if not known:
                    self.journal.state.audit(
                        "dataset_registered",
                        worker_id=worker_id,
                        dataset_id=dataset_id,
                        length=length,
                        unit_size=unit_size,
                    )
            return answer

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
            self._require_healthy()
            self._require_live(worker_id).last_seen = self.clock()
            with self.journal.state.transaction():
                answer = self.pool.lease(
                    worker_id, dataset_id, count, time.time(), next_epoch, lease_key
                )
            faults.crash_point("leased")
            return answer

    def leases_of(self, worker_id: str, dataset_id: str) -> dict:
        """The units of a dataset leased to a live worker, each with the samples still to
        train: what a worker resuming from its own checkpoint reconciles its position with."""
        with self._lock:
            self._require_healthy()
            self._require_live(worker_id).last_seen = self.clock()
            return {
                "dataset_id": dataset_id,
                "units": self.pool.lease_bodies(worker_id, dataset_id),
            }

    def data_progress(self) -> list[dict]:
        with self._lock:
            return self.pool.progress()

    # ----------------------------------------------------------------- weights

    def _adopt_weights(
        self, tensors: Mapping[str, torch.Tensor], kinds: Mapping[str, str] | None
    ) -> None:
        specs = {
            name: TensorSpec(
                name,
                tuple(t.shape),
                t.dtype,
                (kinds or {}).get(name)
                or (
                    TensorKind.TRAINABLE.value
                    if t.is_floating_point()
                    else TensorKind.BOOL_BUFFER.value
                    if t.dtype == torch.bool
                    else TensorKind.INT_BUFFER.value
                ),
            )
            for name, t in tensors.items()
        }
        if self.specs is None:
            self._set_specs(specs, kinds_known=kinds is not None)
        self.frames = self._frames_of(tensors)
        self._durably("writing the initial weights", self._save_initial)
        self.version = 0
        self.result = None
        self.engine.start([0] * self.settings.fragments, self.clock())

    def _save_initial(self) -> None:
        assert self.masters is not None and self.specs is not None
        self.journal.save_initial(
            self.masters,
            self.optimizer.state_dict(copy=False),
            self.specs,
            self.engine.fragment_rounds(),
        )

    def _durably(self, what: str, write: Callable[[], None]) -> None:
        """Run a state write (lock held); a failure stops the server serving until restarted.

        After a failed write the memory and the disk may disagree, and answering from memory
        could publish an outer step a restart would not have: refusing is the safe state.
        """
        try:
            write()
        except Exception as exc:
            self.broken = f"{what} failed: {exc}"
            log.exception("%s failed; refusing requests until restarted", what)
            raise Rejection(503, "checkpoint_failed", self.broken) from None

    def _require_healthy(self) -> None:
        if self.broken is not None:
            raise Rejection(503, "checkpoint_failed", self.broken)

    def upload_initial(self, worker_id: str, tensors: Mapping[str, torch.Tensor]) -> int:
        """The first registered worker's state becomes the global weights (first upload wins)."""
        with self._lock:
            self._require_live(worker_id)
            if self.masters is not None:
                raise Rejection(
                    409,
                    "weights_exist",
                    "the global weights already exist; fetch /v1/weights",
                    current_round=self.version,
                )
            assert self.specs is not None  # a live worker registered its specs
            try:
                check_tensors(tensors, self.specs, float_dtype=None)
            except WireError as error:
                raise rejection_of(error) from None
            self._adopt_weights(tensors, {n: s.kind for n, s in self.specs.items()})
            self.count_in(sum(t.numel() * t.element_size() for t in tensors.values()))
            return self.version

    def weights(self) -> RoundResult:
        """The current global weights, encoded once per version in the download dtype."""
        with self._lock:
            self._require_healthy()  # the masters may hold a step that is not durable
            if self.masters is None:
                raise Rejection(
                    404,
                    "no_weights",
                    "the global weights do not exist yet; "
                    "the first worker to register uploads them",
                )
            result = self.current_weights().lend()
            self.count_out(len(result.body))
            return result

    def current_weights(self) -> Published:
        """The full weights of this version, encoded at most once (lock held)."""
        assert self.frames is not None
        if self.result is None or self.result.round != self.version:
            rounds = self.engine.fragment_rounds()
            self.result = Published(
                self.version,
                self.frames.result(),
                fragment_rounds=tuple(rounds) if self.settings.mode == "streaming" else None,
            )
        return self.result

    def _frames_of(self, tensors: Mapping[str, torch.Tensor]) -> MasterFrames:
        """Master weights from `tensors`, laid out as the result in the download dtype.

        Floating tensors go out in the download dtype; int and bool buffers in their spec's.
        """
        return MasterFrames(tensors, {n: self._wire_dtype(n, t) for n, t in tensors.items()})

    def _wire_dtype(self, name: str, master: torch.Tensor) -> torch.dtype:
        """How a master goes out: floating ones in the download dtype, int and bool buffers in
        their spec's dtype (as the workers' own tensors are)."""
        assert self.specs is not None
        if master.is_floating_point():
            return self.settings.download_dtype
        spec_dtype = self.specs[name].dtype
        return master.dtype if spec_dtype.is_floating_point else spec_dtype

    def encode(self, names: Sequence[str]) -> bytearray:
        """The masters of `names` (a streaming fragment) in the download dtype, ints as their
        spec: a copy, so later outer steps of other fragments leave it as it is."""
        assert self.masters is not None
        masters = self.masters
        out = {n: masters[n].to(self._wire_dtype(n, masters[n])) for n in names}
        return encode_tensors(out, float_dtype=self.settings.download_dtype)

    def count_out(self, n: int) -> None:
        self.bytes_out += n
        self.metrics.bytes_out.inc(n)

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
    ) -> dict:
        """Fold one pseudo-gradient in; idempotent on (worker, round, fragment).

        `units` are the work units the worker finished since its last submission; they are
        completed in the same transaction as the outer step that uses it (journal.commit).

        `tensors` are only read (their values are added into the running sum). A body spooled
        to disk (`SpooledTensors`) is checked and folded a piece at a time. The values are
        scanned for NaN/Inf without the lock, so that one upload's scan overlaps another's
        fold; everything else is decided under it, before the scan and again after it.
        """
        units = sorted(set(units))
        partial = dict(progress or {})
        with self._lock:
            submission = self._admit(
                worker_id, round_number, fragment, tensors, tokens, units, partial
            )
            if not isinstance(submission, Submission):
                return submission  # nothing to fold: the answer
            if isinstance(tensors, SpooledTensors) and self.engine.folds_first(fragment):
                # The first contribution of its round: its sums are new, so it can be checked
                # while it is folded, in one read of the file; a refusal half way changes nothing.
                return self._accept(submission, tensors.checked_pieces())
        max_abs = scan_values(tensors)  # outside the lock
        with self._lock:
            # The state may have moved on during the scan (a commit, a retry that won); the
            # layout (names, shapes, dtypes against fixed specs) cannot have.
            submission = self._admit(
                worker_id,
                round_number,
                fragment,
                tensors,
                tokens,
                units,
                partial,
                check_layout=False,
            )
            if not isinstance(submission, Submission):
                return submission
            return self._accept(submission, max_abs)

    def _admit(
        self,
        worker_id: str,
        round_number: int,
        fragment: int,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        tokens: int,
        units: list[int],
        progress: dict[int, int],
        *,
        check_layout: bool = True,
    ) -> Submission | dict:
        """Everything about a submission but its values (lock held); changes nothing.

        Returns the answer when there is nothing to fold ("committed", "duplicate": the only
        outcomes that touch state, the worker's last_seen), the Submission when it should be
        folded; a refusal raises Rejection.
        """
        self._require_healthy()
        record = self._require_live(worker_id)
        if self.closing:
            raise Rejection(
                503,
                "shutting_down",
                "the server is shutting down; submit again once it is back",
                current_round=self.version,
            )
        if self.masters is None or self.plan is None:
            raise Rejection(409, "no_weights", "no global weights yet; nothing to submit to")
        self._require_round_and_fragment(round_number, fragment)
        if tokens <= 0 and self.settings.weighting == "tokens":
            # It would weigh nothing: a run whose workers all report none would never move.
            raise Rejection(
                422,
                "tokens_required",
                "the server weighs pseudo-gradients by tokens (--weighting tokens) and this "
                f"submission reports {tokens} tokens; send tokens=N, the tokens trained since "
                "the last submission",
                field="tokens",
                got=tokens,
            )
        submission = Submission(record, round_number, fragment, tensors, tokens, units, progress)
        answer = self.engine.admit(submission)
        if answer is not None:
            return answer
        if check_layout:
            self._check_layout(fragment, tensors)
        return submission

    def _require_round_and_fragment(self, round_number: int, fragment: int) -> None:
        """422 for a negative round, or a fragment the plan does not have (once there is one)."""
        if not 0 <= round_number <= MAX_COUNT:
            raise Rejection(
                422,
                "invalid_request",
                f"field 'round' must be in [0, {MAX_COUNT}], got {round_number}",
                field="round",
                got=round_number,
            )
        if self.plan is None:
            return
        fragments = len(self.plan)
        if not 0 <= fragment < fragments:
            allowed = "0 (one fragment)" if fragments == 1 else f"in [0, {fragments - 1}]"
            raise Rejection(
                422,
                "invalid_request",
                f"field 'fragment' must be {allowed} in {self.settings.mode} mode, got {fragment}",
                field="fragment",
                got=fragment,
                allowed=[0, fragments - 1],
            )

    def check_header(self, fragment: int, shapes: Mapping[str, torch.Tensor]) -> None:
        """A submission's layout (its fragment's names, shapes, dtypes) from its header alone,
        before its values arrive, so that a body that will be refused is not read. Without the
        lock: the specs and the plan never change once set. Before they are, or for a fragment
        outside the plan, it says nothing (`submit` then gives the reason)."""
        plan = self.plan
        if self.specs is not None and plan is not None and 0 <= fragment < len(plan):
            self._check_layout(fragment, shapes)

    def _check_layout(
        self, fragment: int, tensors: Mapping[str, torch.Tensor] | SpooledTensors
    ) -> None:
        """Names (of this fragment), shapes and dtypes; the values are scanned apart."""
        assert self.specs is not None and self.plan is not None
        shapes = tensors.meta if isinstance(tensors, SpooledTensors) else tensors
        if len(self.plan) > 1:
            for name in shapes:
                owner = self.owner.get(name, fragment)
                if owner != fragment:
                    raise Rejection(
                        422,
                        "wrong_fragment",
                        f"tensor {name!r} belongs to fragment {owner}, not to fragment "
                        f"{fragment} of this submission",
                        tensor=name,
                        fragment=fragment,
                        belongs_to=owner,
                    )
        expected = {name: self.specs[name] for name in self.plan[fragment]}
        try:
            check_tensors(
                shapes, expected, float_dtype=self.settings.upload_dtype, scan_values=False
            )
        except WireError as error:
            raise rejection_of(error) from None

    def _accept(self, submission: Submission, checked: CheckedPieces | ValueScan) -> dict:
        """Fold an admitted submission (lock held); `checked` is the bound of its values from
        their scan, or, for the first contribution of a round, a reader that checks them."""
        try:
            return self.engine.accept(submission, checked)
        except WireError as error:  # found by a checking reader: nothing was folded
            raise rejection_of(error) from None

    def accepted(self, submission: Submission, target: Round, now: float) -> None:
        """Book a folded submission (lock held): its worker's sign of life, the units it
        reports (they complete with the step that applies it), the bytes it brought."""
        submission.record.last_seen = now  # only now: a rejection leaves the state as it was
        target.add_units(submission.worker_id, submission.units)
        if submission.progress:
            target.add_progress(submission.worker_id, submission.progress)
        submission.record.rounds_contributed += 1
        self.count_in(submission.nbytes)
        faults.crash_point("submission_folded")

    def check_units(self, submission: Submission) -> None:
        """422 unless every unit the submission reports (finished or in part) is the
        worker's, and every partial count fits its unit (lock held; reads only)."""
        self.pool.check_reported(submission.worker_id, submission.units)
        if submission.progress:
            self.pool.check_progress(submission.worker_id, submission.progress)

    def sums_storage(self) -> dict[str, torch.Tensor]:
        """The buffers a running mean's sums are written over, the same every step."""
        assert self.frames is not None
        return self.frames.sums()

    def count_in(self, n: int) -> None:
        self.bytes_in += n
        self.metrics.bytes_in.inc(n)

    def commit_step(self, running: RunningMean, record: CommitRecord) -> None:
        """Apply one outer step's pseudo-gradients (their running sums, used up here) and make
        it durable (lock held).

        The journal writes before any worker can see the result (durability "round"); the
        version then counts the step. Callers publish the result afterwards.
        """
        assert self.frames is not None and self.specs is not None
        self._require_healthy()
        started = time.perf_counter()
        kinds = {name: spec.kind for name, spec in self.specs.items()}
        if running.count:  # (writable() copies the masters away from a straggler's download)
            apply_running_mean(
                self.frames.writable(),
                running,
                self.optimizer,
                kinds,
                policy=self.settings.policy,
            )
        live = len(self.membership.live_ids())
        next_rounds = self.engine.fragment_rounds_after(record)
        self._durably(
            f"writing the checkpoint of round {record.round + 1}",
            lambda: self.journal.commit(
                record,
                self.masters,
                self.optimizer.state_dict(copy=False),
                self.specs,
                {
                    "live_workers": live,
                    "contributions": len(record.contributors),
                    "bytes_in": self.bytes_in,
                    "bytes_out": self.bytes_out,
                },
                next_rounds,
            ),
        )
        self.last_commit = record
        self.version = record.round + 1
        self.rounds_committed += 1
        self.metrics.rounds.inc()
        self.metrics.round.set(self.version)
        self.metrics.outer_step_seconds.observe(time.perf_counter() - started)

    def published(self, description: str, started: float) -> None:
        """After a step's result is out: log it and wake every long-poll (lock held)."""
        log.info(
            "%s committed (version %d), outer step and encoding %.3f s",
            description,
            self.version,
            time.perf_counter() - started,
        )
        self._lock.notify_all()
        faults.crash_point("result_published")

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

        Returns whether a checkpoint had to be written now (durability "interval").
        """
        with self._lock:
            self.closing = True
            flushed = False
            try:
                if self.masters is not None and self.specs is not None and self.broken is None:
                    flushed = self.journal.flush(
                        self.version,
                        self.masters,
                        self.optimizer.state_dict(copy=False),
                        self.specs,
                        self.last_commit,
                        self.engine.fragment_rounds(),
                    )
            finally:
                self.journal.close()
            return flushed

    def wait_result(
        self, round_number: int, worker_id: str | None, wait: float, fragment: int = 0
    ) -> RoundResult | Waiting:
        """Long-poll for a round's result: the new weights, or Waiting when `wait` runs out."""
        wait = min(max(0.0, wait), MAX_WAIT_SECONDS)
        with self._lock:
            self._require_healthy()
            if worker_id is not None:
                self._require_live(worker_id)
            self._require_round_and_fragment(round_number, fragment)
            deadline = self.clock() + wait
            while True:
                outcome = self.engine.poll_result(round_number, fragment, worker_id, self.clock())
                if outcome is not None:
                    if isinstance(outcome, RoundResult):
                        self.count_out(len(outcome.body))
                    return outcome
                now = self.clock()
                remaining = deadline - now
                if remaining <= 0 or self.closing:
                    return self.engine.waiting(round_number, fragment)
                self._lock.wait(timeout=min(remaining, self.engine.wake_within(now)))
