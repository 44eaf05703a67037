"""The operator's actions on a live run (the admin routes and `diloco admin`).

Each action takes the coordinator's lock, is written and audited before it takes effect
(`RunControl`), and answers what it changed. Pausing holds outer steps, not workers: they keep
training and submitting (a submission folds into its round as always), and each waits for its
round's result until the rounds resume; a barrier's timeout does not run while paused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from diloco.server.errors import Rejection
from diloco.server.members.membership import Membership
from diloco.server.members.registrar import Registrar
from diloco.server.model.global_model import GlobalModel
from diloco.server.ops.control import RunControl
from diloco.server.ops.metrics import ServerMetrics
from diloco.server.rounds.engine import RoundEngine
from diloco.server.shards.role import ShardRole
from diloco.server.state.store import StateStore
from diloco.wire import WORKER_ID_PATTERN, encode_tensors, is_worker_id

MAX_AUDIT_ROWS = 1000


class AdminActions:
    """Pause, resume, the outer lr, evictions and bans, the masters, the audit log."""

    def __init__(
        self,
        lock: threading.Condition,
        control: RunControl,
        model: GlobalModel,
        membership: Membership,
        registrar: Registrar,
        engine: RoundEngine,
        state: StateStore,
        metrics: ServerMetrics,
        clock: Callable[[], float],
        role: ShardRole,
    ) -> None:
        self._lock = lock
        self.control = control
        self.model = model
        self.membership = membership
        self.registrar = registrar
        self.engine = engine
        self.state = state
        self.metrics = metrics
        self.clock = clock
        # Sharded servers: the other shards follow shard 0's decisions, so the run is steered
        # there (a ban or pause on one shard alone would make the shards disagree), and only
        # with what it passes on: not the outer lr (each shard steps with its own). In
        # streaming mode, where each shard commits its own fragments, shard 0 tells the
        # others of a pause or resume (and they ask it, with who is live).
        self.steered_elsewhere = role.follows
        self.not_for_shards = frozenset() if role.single else frozenset({"the outer lr"})
        tells_shards = not role.single and role.leads and role.mode == "streaming"
        self.peers = role.peers if tells_shards else None  # shard 0 tells them of a pause

    def _require_steerable(self, action: str = "") -> None:
        if self.steered_elsewhere:
            raise Rejection(
                409,
                "not_shard_0",
                "this shard follows shard 0's decisions: pause, resume, the outer lr, evictions "
                "and bans go to shard 0",
            )
        if action in self.not_for_shards:
            raise Rejection(
                409,
                "not_built",
                f"{action} is not passed on to a sharded run's other shards, which would then "
                "step apart: set it at start on every shard (and restart them to change it)",
                action=action,
            )

    def pause(self, by: str) -> dict:
        self._require_steerable("pause")
        with self._lock:
            changed = self.control.pause(by, self.model.version)
            answer = {"paused": True, "changed": changed, "round": self.model.version}
            stamp = self.control.pause_stamp
        return self._told_shards(answer, True, stamp)

    def resume(self, by: str) -> dict:
        self._require_steerable("resume")
        with self._lock:
            now, since = self._resumed(by)
            if since is not None:
                self._lock.notify_all()  # results that committed now wake their long-polls
            answer = {
                "paused": False,
                "changed": since is not None,
                "paused_seconds": None if since is None else max(0.0, now - since),
                "round": self.model.version,
            }
            stamp = self.control.pause_stamp
        return self._told_shards(answer, False, stamp)

    def _told_shards(self, answer: dict, paused: bool, stamp: int) -> dict:
        """Streaming shard 0: the other shards told at once (outside the lock, so a pause and
        a resume close together may reach a shard in either order: `stamp` orders them); the
        answer names those that did not answer (they follow within a heartbeat interval of
        coming back, when they next ask shard 0 who is live)."""
        if self.peers is None:
            return answer
        return {**answer, "shards_not_told": self.peers.tell_paused(paused, stamp)}

    def follow_pause(self, paused: bool) -> bool:
        """A streaming follower (lock held): pause or resume as shard 0 did; whether that
        changed anything here."""
        if paused:
            return self.control.pause("shard 0", self.model.version)
        return self._resumed("shard 0")[1] is not None

    def _resumed(self, by: str) -> tuple[float, float | None]:
        """Resume (lock held): now, and since when the rounds were paused (None: they were
        not); the rounds that filled up meanwhile commit."""
        now = self.clock()
        since = self.control.resume(by, self.model.version)
        if since is not None:
            self.engine.on_resume(since, now)
        return now, since

    def set_outer_lr(self, lr: float, by: str) -> dict:
        self._require_steerable("the outer lr")
        with self._lock:
            try:
                previous = self.control.set_outer_lr(lr, by, self.model.version)
            except ValueError as exc:
                raise Rejection(422, "invalid_request", str(exc), field="outer_lr") from None
            self.model.optimizer.lr = self.control.settings.outer_lr
            return {
                "outer_lr": self.model.optimizer.lr,
                "previous": previous,
                # The step of this round (or fragment window) is the first to use it.
                "from_round": self.model.version,
            }

    def evict(self, worker_id: str, by: str, *, ban: bool = False, reason: str = "") -> dict:
        """Take a live worker out of the run now (it may register again unless banned).

        Its open round goes on without it; its unfinished work units go back to the pool.
        A ban also stands for an id that is not live (it cannot register again)."""
        self._require_steerable()
        _check_id(worker_id)
        with self._lock:
            live = self.membership.is_live(worker_id)
            if not live and not ban:
                raise Rejection(
                    404,
                    "unknown_worker",
                    f"worker {worker_id!r} is not live; nothing to evict (--ban bans an id "
                    "that is not live)",
                    worker_id=worker_id,
                )
            dropped = False
            with self.state.transaction():  # the ban and the departure, or neither
                if ban:
                    self.control.ban(worker_id, by, self.model.version, reason)
                    # Its pseudo-gradient still held for a barrier is not applied.
                    dropped = self.engine.drop_pending(worker_id, "worker banned by an admin")
                if live:
                    self.registrar.remove(
                        worker_id, "admin_evicted", rounds_go_on=False, by=by, reason=reason
                    )
            if live:
                self.metrics.evictions.inc()  # (committed above, whatever follows)
                try:
                    # Once the ban and the departure are committed: a round this completes
                    # commits its step in a transaction of its own (inside this one, a
                    # failure after it rolled the step's rows back while its weights were
                    # served).
                    self.registrar.rounds_go_on_without(worker_id)
                finally:
                    self._lock.notify_all()  # a barrier that waited on it may have committed
            return {
                "worker_id": worker_id,
                "evicted": live,
                "banned": ban,
                "pending_dropped": dropped,
            }

    def unban(self, worker_id: str, by: str) -> dict:
        self._require_steerable()
        _check_id(worker_id)
        with self._lock:
            if not self.control.unban(worker_id, by, self.model.version):
                raise Rejection(
                    404,
                    "not_banned",
                    f"worker id {worker_id!r} is not banned",
                    worker_id=worker_id,
                )
            return {"worker_id": worker_id, "banned": False}

    def masters_body(self) -> tuple[bytearray | memoryview, int]:
        """The fp32 masters (int and bool buffers in their dtype) as safetensors bytes, and
        their version. With fp32 full-weight downloads that is the body every worker gets,
        lent without a copy; otherwise they are encoded under the lock (a model-sized copy),
        so that no step lands halfway through it."""
        with self._lock:
            self.model.require_healthy()
            masters = self.model.masters
            if masters is None:
                raise Rejection(
                    404,
                    "no_weights",
                    "the global weights do not exist yet (no worker has sent them)",
                )
            settings = self.model.settings
            if settings.download_dtype == torch.float32 and not settings.delta_downloads:
                published = self.model.current_weights(self.engine.fragment_rounds()).lend()
                return published.body, self.model.version
            return encode_tensors(masters), self.model.version

    def stop(self, by: str, supported: bool) -> dict:
        """Audit a graceful stop (the HTTP server then drains and the state is flushed)."""
        if not supported:
            raise Rejection(
                501,
                "stop_unavailable",
                "this server was not started by `diloco server`; stop its process instead",
            )
        with self._lock:
            self.state.audit("stop_requested", round=self.model.version, by=by)
            return {"stopping": True, "round": self.model.version}

    def audit_log(self, after: int = 0, limit: int = MAX_AUDIT_ROWS) -> list[dict]:
        """Audit rows with an id above `after`, oldest first, at most `limit`."""
        with self._lock:
            return self.state.audit_log(after=after, limit=limit)

    def history(self, after: int = -1) -> dict[str, list[dict]]:
        """The metrics history after round `after`: commits, and each live worker at each."""
        with self._lock:
            return self.state.metrics_history(after)

    def state_of(self) -> dict:
        """The operator's switches, for /v1/status."""
        return {
            "paused": self.control.paused,
            "outer_lr": self.control.settings.outer_lr,
            "banned": sorted(self.control.banned),
        }


def _check_id(worker_id: str) -> None:
    if not is_worker_id(worker_id):
        raise Rejection(
            422,
            "invalid_request",
            f"{worker_id!r} is not a worker id (it must match {WORKER_ID_PATTERN})",
            field="worker_id",
            got=worker_id,
        )
