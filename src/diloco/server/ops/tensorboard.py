"""`diloco server --tensorboard DIR`: each commit's metrics as TensorBoard scalars.

The same numbers as the metrics history that the dashboard draws (store.py's `metrics` and
`worker_metrics` rows), step = the round (version) the commit closed: under `run/` the live
workers, the contributions, the MB in and out of the round, the seconds since the previous
commit and of the step itself; under `worker/ID/` each live worker's loss, speed and step.
Written by tensorboardX (`pip install 'diloco[tensorboard]'`) from a thread of this class: a
commit only puts its numbers on an unbounded queue, so a slow or full disk (tensorboardX's own
queue blocks when it is full) never holds the coordinator's lock, and a failed write is
logged, never raised into a commit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FLUSH_SECONDS = 5
log = logging.getLogger("diloco.server")


class TensorBoardScalars:
    """An event-file writer in `directory` (created if missing; a restart appends files)."""

    def __init__(self, directory: Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError(
                "--tensorboard needs tensorboardX: pip install 'diloco[tensorboard]'"
            ) from None
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"--tensorboard {directory} is a file, not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or exc
            raise ValueError(f"--tensorboard {directory} cannot be created ({reason})") from None
        self.writer = SummaryWriter(str(directory), flush_secs=FLUSH_SECONDS)
        self._previous: tuple[float, int, int] | None = None  # (at, bytes in, bytes out)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_all, name="tensorboard", daemon=True)
        self._thread.start()

    def commit(self, round_number: int, metrics: Mapping[str, Any], seconds: float) -> None:
        """Queue the scalars of the commit that closed `round_number` (metrics as the journal
        gets them: live_workers, contributions, bytes_in, bytes_out cumulative, workers)."""
        self._queue.put((round_number, dict(metrics), seconds, time.time()))

    def _write_all(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception:  # a full disk, say: the run goes on without its scalars
                log.exception("writing TensorBoard scalars of round %d failed", item[0])

    def _write(
        self, round_number: int, metrics: Mapping[str, Any], seconds: float, at: float
    ) -> None:
        add = self.writer.add_scalar
        add("run/live_workers", metrics["live_workers"], round_number)
        add("run/contributions", metrics["contributions"], round_number)
        add("run/outer_step_seconds", seconds, round_number)
        before_at, before_in, before_out = self._previous or (None, 0, 0)
        add("run/mb_in_per_round", (metrics["bytes_in"] - before_in) / 1e6, round_number)
        add("run/mb_out_per_round", (metrics["bytes_out"] - before_out) / 1e6, round_number)
        if before_at is not None:
            add("run/round_seconds", at - before_at, round_number)
        self._previous = (at, metrics["bytes_in"], metrics["bytes_out"])
        for worker in metrics.get("workers", ()):
            prefix = f"worker/{worker['worker_id']}/"
            if worker["loss"] is not None:
                add(prefix + "loss", worker["loss"], round_number)
            add(prefix + "steps_per_second", worker["steps_per_second"], round_number)
            add(prefix + "step", worker["step"], round_number)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (waiting at most `timeout` seconds), then close the files."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.writer.close()
