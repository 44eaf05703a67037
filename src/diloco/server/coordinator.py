"""The authority of a DiLoCo run: membership, rounds and barriers, the global weights.

No HTTP here: the app translates requests into these calls and `Rejection`s into responses, and
tests drive the coordinator by calling its methods. Every method takes the one lock; a method
that refuses raises `Rejection` before it changes anything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco import faults
from diloco.algorithm import Contribution, TensorKind, apply_mean, to_fp32_masters
from diloco.server.errors import Rejection
from diloco.server.journal import CommitRecord, RoundJournal
from diloco.server.membership import Membership
from diloco.server.metrics import ServerMetrics
from diloco.server.rounds import Round
from diloco.server.settings import ServerSettings
from diloco.server.store import StateStore
from diloco.wire import (
    PROTOCOL_VERSION,
    WORKER_ID_PATTERN,
    SpooledTensors,
    TensorSpec,
    WireError,
    check_tensors,
    encode_tensors,
    fingerprint,
    first_difference,
    is_worker_id,
)

MAX_WAIT_SECONDS = 120.0
log = logging.getLogger("diloco.server")


@dataclass(frozen=True)
class RoundResult:
    """A committed round's new global weights, encoded once for every worker of the round."""

    round: int
    body: bytearray  # written once at the commit and never changed afterwards


@dataclass(frozen=True)
class Waiting:
    """A long-poll that ended before the round committed."""

    round: int
    waiting_for: list[str]


def _rejection(error: WireError) -> Rejection:
    return Rejection(error.status, error.kind, error.error, **error.detail)


class Coordinator:
    """Synchronous DiLoCo: a barrier per round over the workers live when it started."""

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
        self.masters: dict[str, torch.Tensor] | None = None
        self.specs: dict[str, TensorSpec] | None = None
        self.kinds_known = False
        self.round: Round | None = None
        self.result: RoundResult | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.rounds_committed = 0
        self.closing = False
        # Without a state dir the same journal keeps its tables in memory and writes no files.
        self.journal = journal or RoundJournal(StateStore(None), settings)
        self.pool = self.journal.pool
        self.last_commit: CommitRecord | None = None
        self.broken: str | None = None
        restored = self.journal.restore()
        if restored is not None:
            if initial is not None:
                raise ValueError(
                    f"the state dir already holds round {restored.round}; drop --init to resume"
                )
            self.masters = to_fp32_masters(restored.masters)
            self.optimizer.load_state_dict(restored.optimizer_state)
            self.specs, self.kinds_known = restored.specs, True
            # The workers live at the crash are members again: the restored round waits for
            # them (a missing one is evicted after the heartbeat timeout, as always), so a
            # lone early resubmission cannot commit a round that others were part of.
            for worker_id, session in restored.live_workers:
                self.membership.admit(worker_id, self.started_at, session)
            self.round = Round(
                restored.round, self.membership.live_ids(), settings.weighting, self.started_at
            )
            self.metrics.live_workers.set(len(self.membership.live_ids()))
            self.metrics.round.set(restored.round)
        elif initial is not None:
            self._adopt_weights(initial, kinds=None)
        else:
            # A run that crashed before it had weights: its registered workers still hold
            # their ids, and the first of them may be uploading the initial weights.
            known = self.journal.registered_specs()
            if known is not None:
                self.specs, self.kinds_known = known, True
                for worker_id, session in self.journal.state.live_workers():
                    self.membership.admit(worker_id, self.started_at, session)

    # ----------------------------------------------------------------- read-only views

    @property
    def round_number(self) -> int:
        return 0 if self.round is None else self.round.number

    @property
    def model_fingerprint(self) -> str | None:
        return None if self.specs is None else fingerprint(list(self.specs.values()))

    def info(self) -> dict:
        with self._lock:
            return {
                "protocol_version": PROTOCOL_VERSION,
                "mode": self.settings.mode,
                "round": self.round_number,
                "model_fingerprint": self.model_fingerprint if self.masters is not None else None,
                "settings": self.settings.to_wire(),
            }

    def status(self) -> dict:
        with self._lock:
            now = self.clock()
            uptime = max(1e-9, now - self.started_at)
            return {
                "round": self.round_number,
                "mode": self.settings.mode,
                "workers": [w.to_status(now) for w in self.membership.workers.values()],
                "waiting_for": [] if self.round is None else self.round.waiting_for(),
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
                self.specs = {s.name: s for s in specs}
                self.kinds_known = True
                self.journal.save_registered_specs(self.specs)
            self.membership.admit(worker_id, now, session)
            self.journal.worker_joined(worker_id, session, self.round_number)
            faults.crash_point("registered")
            log.info("worker %s registered at round %d", worker_id, self.round_number)
            if self.round is not None and self.round.first_submission_at is None:
                # Nobody waits on this round yet, so the newcomer can join its barrier now.
                self.round.members.add(worker_id)
            self.metrics.live_workers.set(len(self.membership.live_ids()))
            return self._registration(worker_id)

    def _registration(self, worker_id: str) -> dict:
        return {
            "worker_id": worker_id,
            "round": self.round_number,
            "needs_initial_weights": self.masters is None,
            "model_fingerprint": self.model_fingerprint if self.masters is not None else None,
            "settings": self.settings.to_wire(),
        }

    def deregister(self, worker_id: str) -> None:
        with self._lock:
            self._require_live(worker_id)
            log.info("worker %s left at round %d", worker_id, self.round_number)
            self._remove(worker_id, "deregistered")

    def heartbeat(
        self, worker_id: str, step: int, steps_per_second: float, loss: float | None, tokens: int
    ) -> dict:
        with self._lock:
            record = self._require_live(worker_id)
            record.last_seen = self.clock()
            record.step, record.steps_per_second = step, steps_per_second
            record.loss, record.tokens = loss, tokens
            faults.crash_point("heartbeat")
            return {"round": self.round_number, "recommended_sync_every": None, "command": None}

    def evict_stale(self) -> list[str]:
        """Evict workers silent past the heartbeat timeout; the barrier re-checks at once."""
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
            return stale

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
        self.membership.workers[worker_id].live = False
        keep = set() if self.round is None else self.round.units_of(worker_id)
        self.journal.worker_left(worker_id, self.round_number, reason, keep_units=keep)
        if self.round is not None:
            self.round.leave(worker_id)
        self.metrics.live_workers.set(len(self.membership.live_ids()))
        self._try_commit(self.clock())

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
        self.masters = to_fp32_masters(tensors)
        if self.specs is None:
            self.specs = specs
            self.kinds_known = kinds is not None
        self._durably("writing the initial weights", self._save_initial)
        self.round = Round(0, self.membership.live_ids(), self.settings.weighting, self.clock())
        self.result = None

    def _save_initial(self) -> None:
        assert self.masters is not None and self.specs is not None
        self.journal.save_initial(self.masters, self.optimizer.state_dict(copy=False), self.specs)

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
                    current_round=self.round_number,
                )
            assert self.specs is not None  # a live worker registered its specs
            try:
                check_tensors(tensors, self.specs, float_dtype=None)
            except WireError as error:
                raise _rejection(error) from None
            self._adopt_weights(tensors, {n: s.kind for n, s in self.specs.items()})
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            self.bytes_in += size
            self.metrics.bytes_in.inc(size)
            return self.round_number

    def weights(self) -> RoundResult:
        """The current global weights, encoded once per round in the download dtype."""
        with self._lock:
            if self.masters is None:
                raise Rejection(
                    404,
                    "no_weights",
                    "the global weights do not exist yet; "
                    "the first worker to register uploads them",
                )
            if self.result is None or self.result.round != self.round_number:
                self.result = RoundResult(self.round_number, self._encode_masters())
            self._count_out(len(self.result.body))
            return self.result

    def _encode_masters(self) -> bytearray:
        assert self.masters is not None and self.specs is not None
        out = {}
        for name, master in self.masters.items():
            spec_dtype = self.specs[name].dtype
            out[name] = (
                master
                if master.is_floating_point() or spec_dtype.is_floating_point
                else master.to(spec_dtype)
            )
        return encode_tensors(out, float_dtype=self.settings.download_dtype)

    def _count_out(self, n: int) -> None:
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
    ) -> dict:
        """Fold one pseudo-gradient into its round; idempotent on (worker, round, fragment).

        `units` are the work units the worker finished since its last submission; they are
        completed in the same transaction as this round's commit (see journal.commit).

        The coordinator takes ownership of `tensors` (the app passes views of a private request
        buffer): the round's running sum may reuse their memory, so callers must not reuse them.
        A body spooled to disk (`SpooledTensors`) is checked and folded a piece at a time.
        """
        with self._lock:
            self._require_healthy()
            now = self.clock()
            record = self._require_live(worker_id)
            current = self.round_number
            if self.closing:
                raise Rejection(
                    503,
                    "shutting_down",
                    "the server is shutting down; submit again once it is back",
                    current_round=current,
                )
            if self.masters is None or self.round is None:
                raise Rejection(409, "no_weights", "no global weights yet; nothing to submit to")
            if round_number > current:
                raise Rejection(
                    409,
                    "future_round",
                    f"round {round_number} has not started; the current round is {current}",
                    current_round=current,
                )
            if round_number < current:
                record.last_seen = now
                return self._submit_answer("committed", round_number)
            if fragment != 0:
                raise Rejection(
                    422,
                    "invalid_request",
                    "field 'fragment' must be 0 in sync mode",
                    field="fragment",
                    got=fragment,
                )
            if self.round.has(worker_id, fragment):
                record.last_seen = now
                return self._submit_answer("duplicate", round_number)
            assert self.specs is not None
            spooled = isinstance(tensors, SpooledTensors)
            units = sorted(set(units))
            self.pool.check_reported(worker_id, units)
            try:
                check_tensors(
                    tensors.meta if spooled else tensors,
                    self.specs,
                    float_dtype=self.settings.upload_dtype,
                    scan_values=not spooled,
                )
                if spooled:
                    tensors.check_values()
            except WireError as error:
                raise _rejection(error) from None
            record.last_seen = now  # only now: a rejection leaves the state as it was
            if spooled:
                size = tensors.nbytes
                shapes = {name: tuple(t.shape) for name, t in tensors.meta.items()}
                self.round.add_pieces(worker_id, fragment, shapes, tensors.pieces(), tokens, now)
            else:
                size = sum(t.numel() * t.element_size() for t in tensors.values())
                contribution = Contribution(tensors, tokens, worker_id)
                self.round.add(worker_id, fragment, contribution, now)
            self.round.units[worker_id] = units
            record.rounds_contributed += 1
            self.bytes_in += size
            self.metrics.bytes_in.inc(size)
            faults.crash_point("submission_folded")
            self._try_commit(now)
            return self._submit_answer("accepted", round_number)

    def _submit_answer(self, status: str, round_number: int) -> dict:
        """`waiting_for` is about the submitted round: empty once it has committed."""
        open_round = self.round is not None and self.round.number == round_number
        return {
            "status": status,
            "round": round_number,
            "current_round": self.round_number,
            "waiting_for": self.round.waiting_for() if open_round else [],
        }

    def _try_commit(self, now: float) -> None:
        """Commit the round if its barrier is satisfied (lock held)."""
        current = self.round
        if self.masters is None or current is None or not current.ready(self.settings.min_workers):
            return
        started = time.perf_counter()
        assert current.running is not None and self.specs is not None
        kinds = {name: spec.kind for name, spec in self.specs.items()}
        self._require_healthy()
        apply_mean(
            self.masters, current.running.mean(), self.optimizer, kinds, policy=self.settings.policy
        )
        current.running = None  # free the sums before encoding the result
        record = CommitRecord(
            round=current.number,
            contributors=sorted(current.submitters),
            units=current.all_units(),
            tokens=current.tokens,
            seconds=time.perf_counter() - started,
        )
        live = len(self.membership.live_ids())
        self._durably(  # durable before any worker can see the result
            f"writing the checkpoint of round {current.number + 1}",
            lambda: self.journal.commit(
                record,
                self.masters,
                self.optimizer.state_dict(copy=False),
                self.specs,
                {
                    "live_workers": live,
                    "contributions": len(current.submitted),
                    "bytes_in": self.bytes_in,
                    "bytes_out": self.bytes_out,
                },
            ),
        )
        self.last_commit = record
        self.result = None
        self.result = RoundResult(current.number + 1, self._encode_masters())
        for when in current.submitted.values():
            self.metrics.barrier_wait_seconds.observe(max(0.0, now - when))
        self.round = Round(
            current.number + 1, self.membership.live_ids(), self.settings.weighting, now
        )
        self.rounds_committed += 1
        self.metrics.rounds.inc()
        self.metrics.round.set(self.round.number)
        seconds = time.perf_counter() - started
        self.metrics.outer_step_seconds.observe(seconds)
        log.info(
            "round %d committed: %d contribution(s) from %s, outer step and encoding %.3f s",
            current.number,
            len(current.submitted),
            ", ".join(sorted(current.submitters)),
            seconds,
        )
        self._lock.notify_all()
        faults.crash_point("result_published")

    def close(self) -> None:
        """Stop taking submissions and release every long-poll at once (they answer "waiting").

        The open round's barrier is abandoned: its contributions are not applied, and its
        workers, told after the restart that their submission is missing, send it again.
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
                        self.round_number,
                        self.masters,
                        self.optimizer.state_dict(copy=False),
                        self.specs,
                        self.last_commit,
                    )
            finally:
                self.journal.close()
            return flushed

    def wait_result(
        self, round_number: int, worker_id: str | None, wait: float
    ) -> RoundResult | Waiting:
        """Long-poll for round `round_number`'s result: the new weights, or Waiting."""
        wait = min(max(0.0, wait), MAX_WAIT_SECONDS)
        with self._lock:
            self._require_healthy()
            if worker_id is not None:
                self._require_live(worker_id)
            deadline = self.clock() + wait
            while True:
                if self.round is None or round_number > self.round_number:
                    raise Rejection(
                        409,
                        "future_round",
                        f"round {round_number} has not started; the current round is "
                        f"{self.round_number}",
                        current_round=self.round_number,
                    )
                if round_number < self.round_number:
                    if self.result is None and round_number + 1 == self.round_number:
                        # After a restart: the current weights are exactly that result.
                        self.result = RoundResult(self.round_number, self._encode_masters())
                    if self.result is None or self.result.round != round_number + 1:
                        raise Rejection(
                            410,
                            "result_expired",
                            f"the result of round {round_number} is no longer kept; "
                            "fetch /v1/weights",
                            current_round=self.round_number,
                        )
                    self._count_out(len(self.result.body))
                    return self.result
                now = self.clock()
                if self.round.barrier_expired(now, self.settings.barrier_timeout):
                    raise Rejection(
                        504,
                        "barrier_timeout",
                        f"round {round_number} has waited more than "
                        f"{self.settings.barrier_timeout:g} s for {self.round.waiting_for()}",
                        waiting_for=self.round.waiting_for(),
                        round=round_number,
                    )
                if (
                    worker_id is not None
                    and worker_id in self.round.members
                    and not self.round.has(worker_id, 0)
                    and not self.closing
                ):
                    raise Rejection(
                        409,
                        "not_submitted",
                        f"round {round_number} holds no submission from {worker_id!r} (the "
                        "server restarted since, or it was never sent); submit it again",
                        round=round_number,
                        worker_id=worker_id,
                    )
                remaining = deadline - now
                if remaining <= 0 or self.closing:
                    return Waiting(round_number, self.round.waiting_for())
                self._lock.wait(timeout=min(remaining, 1.0))
