"""When a worker syncs: every H optimizer steps, H as DyLU advises, or fragment by fragment.

H counts optimizer steps, not batches (the worker's post-step hook drives these), so
gradient accumulation changes nothing. The server states H; in async mode with DyLU its
heartbeat answers may lower this worker's H, which applies from the next window. In
streaming mode each fragment f owns the window ending at (f + 1) S of every cycle of H
steps (S = H / P): it is sent at S - tau and merged at S (`algorithm.StreamingSchedule`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from diloco.algorithm import StreamingSchedule

log = logging.getLogger("diloco.worker")


class EveryH:
    """A sync window is the server's H optimizer steps (sync; async without DyLU)."""

    def __init__(self, sync_every: int) -> None:
        self.sync_every = sync_every
        self.window = sync_every  # H of the window under way
        self.steps_in_round = 0

    def stepped(self) -> bool:
        """One more optimizer step: True when the window is full and the worker must sync."""
        self.steps_in_round += 1
        return self.steps_in_round >= self.window

    def round_done(self) -> None:
        self.steps_in_round = 0

    def advise(self, answer: Mapping[str, Any]) -> None:
        """A heartbeat answer; a fixed H takes no advice."""

    def next_window(self) -> int:
        """H of the next window (rank 0's choice; the worker broadcasts it)."""
        return self.sync_every


class DyLU(EveryH):
    """The next window's H is the server's latest advice (DyLU: slow workers do fewer steps)."""

    def __init__(self, sync_every: int) -> None:
        super().__init__(sync_every)
        self.advised: int | None = None

    def advise(self, answer: Mapping[str, Any]) -> None:
        recommended = answer.get("recommended_sync_every")
        if isinstance(recommended, int) and recommended >= 1:
            if recommended != self.advised:
                log.info("the server recommends H = %d for this worker (DyLU)", recommended)
            self.advised = recommended

    def next_window(self) -> int:
        return self.advised or self.sync_every


def start_position(fragment_rounds: list[int], sync_every: int, fragments: int) -> int:
    """The schedule step a worker joining at these fragment rounds starts from.

    In a run that keeps up, fragments sync in order, so rounds look like [c+1]*k + [c]*(P-k):
    cycle c, fragment k's window is next. The fragment with the fewest rounds (the first of
    those) tells both.
    """
    lowest = min(fragment_rounds)
    next_fragment = fragment_rounds.index(lowest)
    return lowest * sync_every + next_fragment * (sync_every // fragments)


class FragmentWindows:
    """Streaming: this worker's step in the fragments' schedule, and each fragment's last merge."""

    def __init__(self, sync_every: int, fragments: int, delay: int, fragment_rounds: list[int]):
        self.sync_every = sync_every
        self.fragments = fragments
        self.schedule = StreamingSchedule(sync_every, fragments, delay)
        self.step = start_position(fragment_rounds, sync_every, fragments)
        self.last_merge = [self.step] * fragments  # the step each fragment last took G' at

    @property
    def delay(self) -> int:
        return self.schedule.delay

    def reposition(self, fragment_rounds: list[int]) -> None:
        """After a rebase: the schedule position the server's fragment rounds imply."""
        self.step = start_position(fragment_rounds, self.sync_every, self.fragments)
        self.last_merge = [self.step] * self.fragments

    def merged(self, fragment: int) -> None:
        self.last_merge[fragment] = self.step

    def trained_since_merge(self, fragment: int) -> bool:
        return self.last_merge[fragment] < self.step
