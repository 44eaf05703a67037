"""What a long-poll or a weights request answers: encoded weights once per step, or "waiting"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from diloco.wire.format.layout import FrameBuffer, LentBytes

NO_BODY = memoryview(b"")


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
    # the full weights when they are encoded on demand; `body` is then NO_BODY until
    # `for_anchor`, which the coordinator calls under its lock, gives what is sent
    whole: OnDemand | None = None

    def for_anchor(self, have: int | None) -> RoundResult:
        """What a worker whose anchor is at `have` downloads: the delta when it holds the
        weights the step started from, else the full weights."""
        if have is None or self.delta is None or have != self.round - 1:
            body = self.body if self.whole is None else self.whole.view()
            return replace(self, body=body, delta=None, whole=None)
        return replace(self, body=self.delta, delta=None, delta_from=have, whole=None)


class OnDemand:
    """A streaming fragment's full weights, encoded the first time a worker needs them.

    Most workers hold the fragment's last weights and take the step's delta, so with
    --download-codec the copy (half the fp32 model per fragment of two, for each fragment's
    result) is mostly never made. It is exact whenever it is made: a fragment's tensors move
    only at that fragment's next step, which replaces its result first (BarrierRounds)."""

    def __init__(self, encode: Callable[[], bytearray]) -> None:
        self._encode = encode
        self._body: bytearray | None = None

    def view(self) -> memoryview:
        """The body, read-only (encoded now if no worker needed it before)."""
        if self._body is None:
            self._body = self._encode()
        return memoryview(self._body).toreadonly()


@dataclass(frozen=True)
class Published:
    """The body every worker of a step downloads, written once when the step commits.

    `frame` is the masters' own buffer (fp32 downloads), or an encoding of them, both reused
    from step to step once no response reads them (see MasterFrames); a streaming fragment's
    result is a copy of its tensors (`bytearray`), never written again.
    """

    round: int
    frame: FrameBuffer | bytearray | OnDemand
    fragment: int | None = None
    fragment_rounds: tuple[int, ...] | None = None
    # the step's coded delta (--download-codec), written over by a later step only once no
    # response reads it
    delta: LentBytes | None = None

    def lend(self) -> RoundResult:
        """A view for one response; the buffer is not written again while any is alive."""
        whole = self.frame if isinstance(self.frame, OnDemand) else None
        if isinstance(self.frame, FrameBuffer):
            body = self.frame.lend()
        elif whole is not None:
            body = NO_BODY
        else:
            body = memoryview(self.frame).toreadonly()
        delta = None if self.delta is None else self.delta.lend()
        return RoundResult(
            self.round, body, self.fragment, self.fragment_rounds, delta, whole=whole
        )


@dataclass(frozen=True)
class Waiting:
    """A long-poll that ended before the round committed."""

    round: int
    waiting_for: list[str]
    more_submissions_needed: int = 0  # beyond those of waiting_for (--min-workers)
