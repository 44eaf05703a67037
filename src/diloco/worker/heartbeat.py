"""A daemon thread that tells the server the worker is alive and how it is doing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from diloco.worker.errors import ServerError, ServerUnavailable
from diloco.worker.net.client import DiLoCoClient

log = logging.getLogger("diloco.worker")


class Heartbeat:
    """Beats every `interval` seconds with the report from `snapshot()`.

    An `unknown_worker` answer (the server evicted us or restarted) calls `on_unknown`, which
    re-registers under the same id; transport failures are logged and the next beat tries again.
    Every answer goes to `on_answer` (it may carry a recommended H, from DyLU).
    """

    def __init__(
        self,
        client: DiLoCoClient,
        worker_id: Callable[[], str],
        interval: float,
        snapshot: Callable[[], dict],
        on_unknown: Callable[[], None],
        on_answer: Callable[[dict], None] | None = None,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.interval = interval
        self.snapshot = snapshot
        self.on_unknown = on_unknown
        self.on_answer = on_answer
        self.stopped = threading.Event()
        self.beats = 0
        self.thread = threading.Thread(target=self._run, name="diloco-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.interval + 5)

    def beat(self) -> None:
        report = self.snapshot()
        try:
            answer = self.client.heartbeat(self.worker_id(), **report)
            self.beats += 1
            if self.on_answer is not None:
                self.on_answer(answer)
        except ServerError as exc:
            if exc.kind == "unknown_worker":
                log.warning("server no longer knows worker %s; registering again", self.worker_id())
                self.on_unknown()
            else:
                log.warning("heartbeat refused: %s", exc)
        except ServerUnavailable as exc:
            log.warning("heartbeat failed: %s", exc)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except Exception:  # the thread must outlive any single failure
                log.exception("heartbeat error")
