"""Which weights this process itself sent each worker, for delta downloads after a rollback.

After a restart that may have rolled back (durability "interval"), the rounds past the
restored one happen again, on another timeline, and a worker still holding an anchor of the
old one names the same round. A delta (--download-codec) then goes only to a worker that this
process itself brought to that round.
"""

from __future__ import annotations


class SentRounds:
    """(worker, fragment) -> the round of the last result this process sent it."""

    def __init__(self) -> None:
        self.rollback_possible = False  # set once a restart restored an "interval" state
        self._sent: dict[tuple[str, int], int] = {}

    def sent(self, worker_id: str | None, fragment: int, round_number: int) -> None:
        if self.rollback_possible and worker_id is not None:
            self._sent[(worker_id, fragment)] = round_number

    def vouched(self, worker_id: str | None, fragment: int, have: int | None) -> int | None:
        """`have` if it can only name our own timeline's weights."""
        if not self.rollback_possible:
            return have
        if worker_id is None or self._sent.get((worker_id, fragment)) != have:
            return None
        return have
