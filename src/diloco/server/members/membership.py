"""Who is training: registered workers, their last sign of life and what they reported."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from diloco.algorithm import dylu_local_steps
from diloco.algorithm.dylu import MAX_SPEED_RATIO
from diloco.server.errors import Rejection

SPEED_WINDOWS = 5  # DyLU smooths a worker's speed over its last windows (median)


@dataclass
class WorkerRecord:
    """One worker as the coordinator knows it; `live` turns False on eviction or departure."""

    worker_id: str
    registered_at: float
    last_seen: float
    live: bool = True
    step: int = 0
    steps_per_second: float = 0.0
    loss: float | None = None
    tokens: int = 0
    rounds_contributed: int = 0
    session: str | None = None
    windows_reported: int = 0
    speed_samples: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_WINDOWS))

    def add_speed_sample(self, windows: int, steps_per_second: float) -> None:
        """One sample per finished window: a heartbeat repeating the same window adds nothing."""
        if windows > self.windows_reported and steps_per_second > 0:
            self.speed_samples.append(steps_per_second)
        self.windows_reported = max(self.windows_reported, windows)

    @property
    def smoothed_speed(self) -> float | None:
        """The median of the recent windows' speeds, so one noisy window does not swing H."""
        return statistics.median(self.speed_samples) if self.speed_samples else None

    def to_status(self, now: float) -> dict:
        return {
            "worker_id": self.worker_id,
            "live": self.live,
            "step": self.step,
            "steps_per_second": self.steps_per_second,
            "loss": self.loss,
            "tokens": self.tokens,
            "last_seen_seconds_ago": round(max(0.0, now - self.last_seen), 3),
            "rounds_contributed": self.rounds_contributed,
        }


class Membership:
    """The registry of workers, with a lock of its own.

    Heartbeats take only this lock, never the coordinator's: a commit that holds the
    coordinator for a slow checkpoint write must not hold back the signs of life whose absence
    would then evict every worker the moment it ends. Everything else mutates it under the
    coordinator's lock as well (always taken first), so it sees a consistent registry.
    """

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self.lock = threading.RLock()
        # A restarted server's rounds contributed per worker, from the state dir: a record
        # made for that id starts from its count, so no count goes back after a restart.
        self.restored_counts: dict[str, int] = {}

    def live_ids(self) -> set[str]:
        with self.lock:
            return {w.worker_id for w in self.workers.values() if w.live}

    def records(self) -> list[WorkerRecord]:
        with self.lock:
            return list(self.workers.values())

    def snapshot(self, now: float) -> list[dict]:
        """Every live worker's status now (a commit's row of the metrics history)."""
        with self.lock:
            return [w.to_status(now) for w in self.workers.values() if w.live]

    def get_live(self, worker_id: str) -> WorkerRecord | None:
        record = self.workers.get(worker_id)
        return record if record is not None and record.live else None

    def require_live(self, worker_id: str) -> WorkerRecord:
        """The live worker's record, or Rejection 404 (evicted or never registered)."""
        record = self.get_live(worker_id)
        if record is None:
            raise Rejection(
                404,
                "unknown_worker",
                f"worker {worker_id!r} is not registered (evicted or never registered); "
                "register again",
                worker_id=worker_id,
            )
        return record

    def is_live(self, worker_id: str) -> bool:
        return self.get_live(worker_id) is not None

    def admit(self, worker_id: str, now: float, session: str | None = None) -> WorkerRecord:
        """Register or re-register (after eviction) under `worker_id`; keeps the counters."""
        with self.lock:
            record = self.workers.get(worker_id)
            if record is None:
                record = WorkerRecord(worker_id, registered_at=now, last_seen=now)
                record.rounds_contributed = self.restored_counts.pop(worker_id, 0)
                self.workers[worker_id] = record
            record.live = True
            record.last_seen = now
            record.session = session
            return record

    def depart(self, worker_id: str) -> None:
        """Evicted or gone: no longer live (its counters stay for the status page)."""
        with self.lock:
            self.workers[worker_id].live = False

    def beat(
        self,
        worker_id: str,
        now: float,
        step: int,
        steps_per_second: float,
        loss: float | None,
        tokens: int,
        windows: int | None,
    ) -> WorkerRecord | None:
        """Record a heartbeat's progress; None (nothing recorded) if the worker is not live."""
        with self.lock:
            record = self.get_live(worker_id)
            if record is None:
                return None
            record.last_seen = now
            record.step, record.steps_per_second = step, steps_per_second
            record.loss, record.tokens = loss, tokens
            if windows is not None:
                record.add_speed_sample(windows, steps_per_second)
            return record

    def dylu_advice(self, sync_every: int) -> dict[str, int]:
        """DyLU: H_w = max(1, floor(v_w / max v * H)) over live workers' smoothed speeds, for
        each worker that has one."""
        with self.lock:
            speeds = {
                w.worker_id: w.smoothed_speed
                for w in self.workers.values()
                if w.live and w.smoothed_speed is not None and w.smoothed_speed > 0
            }
        return dylu_local_steps(speeds, sync_every, MAX_SPEED_RATIO)

    def stale(self, now: float, timeout: float) -> list[str]:
        """Live workers silent for longer than `timeout` seconds."""
        with self.lock:
            return [
                w.worker_id for w in self.workers.values() if w.live and now - w.last_seen > timeout
            ]
