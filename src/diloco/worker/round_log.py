"""The worker's lines about its progress, on the "diloco.worker" logger: one when it joins
(INFO), one per round (INFO), one when the server answers again after retries (WARNING, as
the retries it ends were). `diloco worker` shows them all; a library user sees the
warnings, and the rest with `logging.getLogger("diloco.worker").setLevel(logging.INFO)`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from diloco.worker.net.transport import ClientStats

log = logging.getLogger("diloco.worker")


def joined_line(
    worker_id: str, server: str, round_number: int, mode: str, sync_every: int, step: int
) -> str:
    """The join line: who joined where, at which round, in which mode and with which H."""
    line = f"worker {worker_id} joined {server} at round {round_number}"
    line += f" ({mode} mode, H={sync_every})"
    return line + (f", resuming at step {step}" if step else "")


def log_recovered(operation: str, retries: int, seconds: float) -> None:
    """A call that was retried got its answer: the server is back (after the retry lines)."""
    log.warning(
        "%s: the server answered again after %d retr%s in %.1f s",
        operation,
        retries,
        "y" if retries == 1 else "ies",
        seconds,
    )


@dataclass(frozen=True)
class RoundFigures:
    """One round as this worker saw it: where it ended, the megabytes its client sent and
    received during it, the seconds training was blocked on the server, and (sync and async
    rounds) where those seconds went: `DiLoCoWorker.last_round_phases`, whose encode, upload,
    wait, download, apply and other add up to its "blocked" (the total), and whose "save" (the
    worker's checkpoint after the exchange) is not blocked time. A benchmark tells the round's
    own cost (encode, upload, download, apply) from the wait at its barrier by them. A
    streaming cycle's phases are its sends' time on the training thread (send), its merges'
    waits for their syncs (wait) and the rest of its merges (mix):
    `FragmentStreamer.blocked_split`."""

    step: int
    loss: float | None
    mb_up: float
    mb_down: float
    blocked_seconds: float
    phases: dict[str, float] = field(default_factory=dict)


class RoundLines:
    """One line per round: the round, the step, the last reported loss, the megabytes this worker's
    client sent and received since the last line, and the seconds training was blocked on its syncs
    since then (coding, waiting on the server, taking results in). Every round's figures are kept
    (`rounds`) for the worker's --json, whether or not the lines are shown."""

    def __init__(self) -> None:
        self._sent = self._received = 0
        self._blocked = 0.0
        self.rounds: list[RoundFigures] = []

    def since(self, client: ClientStats | None) -> None:
        """Count traffic from here (after joining: the first round's line is the round's)."""
        if client is not None:
            self._sent, self._received = client.bytes_sent, client.bytes_received

    def record(
        self,
        step: int,
        loss: float | None,
        client: ClientStats | None,
        blocked_seconds: float,
        phases: dict[str, float] | None = None,
    ) -> RoundFigures:
        """The round that just ended, from the counters' growth since the last one."""
        sent = client.bytes_sent if client is not None else 0
        received = client.bytes_received if client is not None else 0
        figures = RoundFigures(
            step,
            loss,
            (sent - self._sent) / 1e6,
            (received - self._received) / 1e6,
            blocked_seconds - self._blocked,
            dict(phases or {}),
        )
        self._sent, self._received, self._blocked = sent, received, blocked_seconds
        self.rounds.append(figures)
        return figures

    @staticmethod
    def line(what: str, figures: RoundFigures) -> str:
        shown = "-" if figures.loss is None else f"{figures.loss:.4f}"
        return (
            f"{what} done at step {figures.step}: loss {shown}, {figures.mb_up:.2f} MB up, "
            f"{figures.mb_down:.2f} MB down, blocked {figures.blocked_seconds:.1f} s"
        )
