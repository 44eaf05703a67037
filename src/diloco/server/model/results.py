"""What a long-poll or a weights request answers: encoded weights once per step, or "waiting"."""

from __future__ import annotations

from dataclasses import dataclass, replace

from diloco.wire.format.layout import FrameBuffer, LentBytes


@dataclass(frozen=True)
class RoundResult:
    """New global weights, as one worker receives them.

    `round` is what the weights start: the next round (sync), the fragment's next round
    (streaming, with `fragment` set), or the run's version (async, and `GET /v1/weights`).
    `fragment_rounds` accompanies full weights in streaming mode: each fragment's round.
    """

    round: int
    body: memoryview  # read-only, lent from the step's one buffer; never copied per worker
    fragment: int | None = None
    fragment_rounds: tuple[int, ...] | None = None
    # --download-codec: the step's coded delta, for a worker whose anchor is at round - 1
    delta: memoryview | None = None
    delta_from: int | None = None  # set when `body` is the delta (see for_anchor)

    def for_anchor(self, have: int | None) -> RoundResult:
        """What a worker whose anchor is at `have` downloads: the delta when it holds the
        weights the step started from, else the full weights."""
        if have is None or self.delta is None or have != self.round - 1:
            return replace(self, delta=None)
        return replace(self, body=self.delta, delta=None, delta_from=have)


@dataclass(frozen=True)
class Published:
    """The body every worker of a step downloads, written once when the step commits.

    `frame` is the masters' own buffer (fp32 downloads), or an encoding of them, both reused
    from step to step once no response reads them (see MasterFrames); a streaming fragment's
    result is a copy of its tensors (`bytearray`), never written again.
    """

    round: int
    frame: FrameBuffer | bytearray
    fragment: int | None = None
    fragment_rounds: tuple[int, ...] | None = None
    # the step's coded delta (--download-codec), written over by a later step only once no
    # response reads it
    delta: LentBytes | None = None

    def lend(self) -> RoundResult:
        """A view for one response; the buffer is not written again while any is alive."""
        if isinstance(self.frame, FrameBuffer):
            body = self.frame.lend()
        else:
            body = memoryview(self.frame).toreadonly()
        delta = None if self.delta is None else self.delta.lend()
        return RoundResult(self.round, body, self.fragment, self.fragment_rounds, delta)


@dataclass(frozen=True)
class Waiting:
    """A long-poll that ended before the round committed."""

    round: int
    waiting_for: list[str]
    more_submissions_needed: int = 0  # beyond those of waiting_for (--min-workers)
