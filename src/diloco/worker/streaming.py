"""Streaming DiLoCo on the worker: fragments sent on a schedule, merged tau steps later.

Within every cycle of H inner steps, fragment f owns the window of S = H / P steps ending at
(f + 1) S (`schedule.FragmentWindows`). At step S - tau of its window the worker computes the
fragment's pseudo-gradient (anchor_f - local_f) and hands it to a background thread, which
submits it and long-polls the fragment round's result while training goes on. With a
quantized or sparse codec that keeps an error-feedback residual and an fp32 anchor on the
CPU, the send only copies the fragment's values (a pass) and the thread takes
e' = beta e + g from that copy and codes the body (`UploadCoder.coding_from`: a top-k body's
coding is most of a send's time); a checkpoint taken meanwhile waits for that coding, and
the fragment's anchor stays as it is until its merge. At the
window's end the worker waits for that thread (its one wait in the schedule) and merges:
theta_f = (1 - alpha) G'_f + alpha L_f, with L_f the local values at merge time, and G'_f
becomes the fragment's anchor. At most one fragment is in flight: the next send comes after
this merge.

At the end (`flush`) every fragment whose local values differ from its global ones is synced
once more, so no training is lost and every worker ends on the global model.

A sync that fails (the server unreachable past the retry budget, or longer than the worker's
`fragment_timeout`) keeps the old anchor and the same fragment round: the fragment is sent
again, against that anchor, at its next send step. The other fragments are untouched.

The streamer works with the worker's parts, not the worker: the server session (rank 0
only), the anchor, the work units, the token tally and the pace; `on_merged` tells the
worker that a fragment's window ended (it saves its checkpoint once a cycle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.algorithm import alpha_merge
from diloco.wire.validation import MAX_UNITS_PER_SUBMISSION
from diloco.worker.anchor import Anchor
from diloco.worker.data.tokens import TokenTally
from diloco.worker.data.units import UnitReports
from diloco.worker.errors import ClientClosed, ServerUnavailable
from diloco.worker.pace import Pace
from diloco.worker.parallel import distributed
from diloco.worker.schedule import FragmentWindows
from diloco.worker.session import ServerSession, SubmitAnswer
from diloco.worker.settings import WorkerSettings
from diloco.worker.upload_coder import DeferredBody, UploadCoder

__all__ = ["FragmentOutcome", "FragmentStreamer", "InFlight"]

log = logging.getLogger("diloco.worker")


@dataclass
class FragmentOutcome:
    """What an in-flight fragment sync ended with (filled in by its thread)."""

    fragment: int
    round: int
    finished: list[int] = field(default_factory=list)  # work units finished at the send
    units: list[int] = field(default_factory=list)  # those reported with it (all fragments done)
    tokens: int = 0  # trained since the fragment's last send
    tensors: dict[str, torch.Tensor] | None = None  # G'_f (or every tensor, on a rebase)
    next_round: int | None = None
    rebase_rounds: list[int] | None = None  # the server was behind: its full state and rounds
    folded: bool = False  # the server folded our body in (its error feedback stands)
    # the submission's answer as it came: a merge that gives up on the sync settles by it
    answer: SubmitAnswer = field(default_factory=SubmitAnswer)
    error: BaseException | None = None
    # the body's coding on the fragment's thread (~0 where it was coded at the send; not yet
    # written when a merge gave up on its flight)
    coding_seconds: float = 0.0


@dataclass
class InFlight:
    outcome: FragmentOutcome
    merge_at: int  # the schedule step at which it is merged
    thread: threading.Thread
    cancel: threading.Event = field(default_factory=threading.Event)


class FragmentStreamer:
    """The streaming schedule of one worker: sends, in-flight sync, merges, and the final flush.

    `session` is None on the ranks of a torch.distributed group other than 0: they take no
    part in the network and receive each G'_f by broadcast at the merge.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        plan: list[list[str]],
        fragment_rounds: list[int],
        fragment_timeout: float | None,
        *,
        session: ServerSession | None,
        anchor: Anchor,
        units: UnitReports,
        tokens: TokenTally,
        pace: Pace,
        on_merged: Callable[[int], None],
        uploads: UploadCoder,
        before_send: Callable[[], None] = lambda: None,
        coding: Callable[[Callable[[], DeferredBody]], DeferredBody] = lambda code: code(),
    ) -> None:
        if len(plan) != settings.fragments or len(fragment_rounds) != settings.fragments:
            raise ValueError(
                f"the server states {settings.fragments} fragments but a plan of {len(plan)} "
                f"and {len(fragment_rounds)} fragment rounds"
            )
        self.plan = plan
        self.windows = FragmentWindows(
            settings.sync_every, settings.fragments, settings.delay, fragment_rounds
        )
        self.alpha = settings.alpha
        self.uploads = uploads
        self.before_send = before_send  # every rank, before a fragment's values leave
        self.coding = coding  # runs a body's coding (the worker's: a GPU out of memory -> CPU)
        self.fragment_rounds = list(fragment_rounds)
        self.fragment_timeout = fragment_timeout
        self.session = session
        self.anchor = anchor
        self.units = units
        self.tokens = tokens
        self.pace = pace
        self.on_merged = on_merged
        self.in_flight: InFlight | None = None
        self.syncs = 0
        self.failures = 0
        self.coding_seconds = 0.0  # bodies coded on the fragments' threads, beside training
        # The blocked time of sends and merges, split: what sends took on the training thread,
        # what merges spent waiting for their syncs, and the rest of the merges (the mix).
        self.send_seconds = 0.0
        self.merge_wait_seconds = 0.0
        self.merge_seconds = 0.0  # whole merges: their waits and mixes
        # A work unit is in the global model once every fragment has synced since it finished:
        # it is reported with the submission that completes that set.
        self.covered: dict[int, set[int]] = {}
        self.tokens_at_send = [tokens.total] * len(plan)
        # fragment -> the round of it whose body the server took in a sync that then failed
        self.folded_rounds: dict[int, int] = {}

    @property
    def step(self) -> int:
        """This worker's step in the fragments' schedule."""
        return self.windows.step

    def reposition(self, fragment_rounds: list[int]) -> None:
        """After a rebase: take the server's rounds and the schedule position they imply."""
        self.fragment_rounds = list(fragment_rounds)
        self.windows.reposition(self.fragment_rounds)

    # ----------------------------------------------------------------- the schedule

    def after_step(self) -> None:
        """One inner step done: send what is due, then merge what is due (tau = 0: both)."""
        windows = self.windows
        windows.step += 1
        for fragment in windows.schedule.fragments_sent_at(windows.step):
            self.send(fragment)
        for fragment in windows.schedule.fragments_merged_at(windows.step):
            self.merge(fragment)

    def send(self, fragment: int) -> None:
        """Start the fragment's sync in the background (rank 0 talks; others wait for merge).
        Its time on the training thread (coding the body, or what of it is not deferred to
        the sync's thread) counts as blocked, as a sync round's encode does."""
        self.before_send()
        if self.in_flight is not None:  # cannot happen with tau < S; never two at once
            self.merge(self.in_flight.outcome.fragment)
        started = time.monotonic()
        try:
            self._start(fragment)
        finally:
            took = time.monotonic() - started
            self.pace.blocked_seconds += took
            self.send_seconds += took

    def _start(self, fragment: int) -> None:
        outcome = FragmentOutcome(fragment, self.fragment_rounds[fragment])
        outcome.answer.earlier_folded = self.folded_rounds.get(fragment) == outcome.round
        merge_at = self.windows.step + self.windows.delay
        session = self.session
        if session is None:
            self.in_flight = InFlight(outcome, merge_at, threading.Thread(target=lambda: None))
            return
        names = self.plan[fragment]

        def code() -> DeferredBody:
            state = self.anchor.model.state_dict()
            anchor = {n: self.anchor.tensors[n] for n in names}
            local = {n: state[n] for n in names}
            if self.anchor.device.type == "cpu":  # what needs `local` now, the rest later
                return self.uploads.coding_from(anchor, local)
            # on a GPU all of it here, where running out of memory moves it to the host
            return DeferredBody.ready(self.uploads.body_from(anchor, local))

        body = self.coding(code)  # the rest of its coding: on the fragment's thread, first
        try:
            outcome.finished = self.units.finished()
            everything = set(range(len(self.plan)))
            outcome.units = [
                unit
                for unit in outcome.finished
                if self.covered.get(unit, set()) | {fragment} == everything
            ][:MAX_UNITS_PER_SUBMISSION]
            outcome.tokens = self.tokens.total - self.tokens_at_send[fragment]
            cancel = threading.Event()
            thread = threading.Thread(
                target=self._run,
                args=(session, outcome, body, outcome.units, cancel.is_set),
                name=f"diloco-fragment-{fragment}",
                daemon=True,
            )
            thread.start()
        except BaseException:
            body.abandon()  # (unless its thread took it: what waits for it must not hang)
            raise
        self.in_flight = InFlight(outcome, merge_at, thread, cancel)

    @staticmethod
    def _run(
        session: ServerSession,
        outcome: FragmentOutcome,
        body: DeferredBody,
        units: list[int],
        cancelled: Callable[[], bool],
    ) -> None:
        try:
            coding = time.monotonic()
            coded = body()
            outcome.coding_seconds = time.monotonic() - coding
            if cancelled():  # the merge gave up on it while it coded: nothing goes out
                raise ClientClosed(f"the sync of round {outcome.round} was given up")
            got = session.exchange(
                coded,
                units,
                outcome.round,
                fragment=outcome.fragment,
                cancelled=cancelled,
                tokens=outcome.tokens,
                answer=outcome.answer,
            )
            if got.rebase_rounds is not None:
                outcome.rebase_rounds = got.rebase_rounds
            outcome.tensors, outcome.next_round = got.tensors, got.round
            outcome.folded = got.folded
        except BaseException as exc:  # reported at the merge, on the training thread
            outcome.error = exc

    def merge(self, fragment: int) -> None:
        """Wait for the fragment's sync and mix its result in (every rank takes part). All of
        it but the checkpoint that may follow counts as blocked, as a sync round's wait,
        download and apply do; `merge_wait_seconds` keeps the waiting part apart."""
        flight = self.in_flight
        if flight is None or flight.outcome.fragment != fragment:
            return  # nothing was sent for it (a worker joining mid-cycle)
        self.in_flight = None
        started = time.monotonic()
        try:
            merged = self._merge(flight, fragment)
        finally:
            took = time.monotonic() - started
            self.pace.blocked_seconds += took
            self.merge_seconds += took
        if merged:
            self.on_merged(fragment)  # (a checkpoint once a cycle: not blocked time)

    def _merge(self, flight: InFlight, fragment: int) -> bool:
        """`merge`'s work; True when the fragment's result was mixed in."""
        started = time.monotonic()
        try:
            header = distributed.lead(lambda: self._wait(flight), distributed.broadcast_json)
        finally:
            self.merge_wait_seconds += time.monotonic() - started
        self.coding_seconds += flight.outcome.coding_seconds
        outcome = flight.outcome
        if self.session is not None:  # the leader's error feedback: was the body folded in?
            if header["status"] == "failed":
                # The server may have taken the body before the sync failed (its residual
                # stands), or may yet take it (a sync given up on while it runs): either way
                # the fragment's next body for this round, answered "duplicate", is not the
                # one folded.
                folded = outcome.answer.folded
                if folded or flight.thread.is_alive():
                    self.folded_rounds[fragment] = outcome.round
            else:
                folded = header["status"] == "merged" and outcome.folded
                self.folded_rounds.pop(fragment, None)
            self.uploads.settle(folded)
        if header["status"] == "failed":
            self.failures += 1
            log.warning(
                "fragment %d sync of round %d failed (%s); keeping its anchor, it is sent again "
                "at its next window",
                fragment,
                header["round"],
                header["error"],
            )
            return False
        tensors = flight.outcome.tensors or {}
        if header["status"] == "rebase":
            self.anchor.adopt_everywhere(tensors, header["version"])
            self.reposition(header["fragment_rounds"])
            if self.session is not None:  # the training since is in no model now
                self.covered.clear()
                self.units.round_dropped()
            return False
        names = self.plan[fragment]
        on_model = self.anchor.broadcast_fragment(tensors, names)
        # (rank 0's anchor takes the values as they came, on its own device: no copy back
        # from a GPU model's)
        self._mix(fragment, on_model, {n: tensors[n] for n in names if n in tensors})
        self.fragment_rounds[fragment] = header["next_round"]
        self.windows.merged(fragment)
        self.syncs += 1
        if self.session is not None:
            self._covered(fragment, flight.outcome)
            self.tokens_at_send[fragment] += flight.outcome.tokens
        return True

    @property
    def last_fragment(self) -> int:
        return len(self.plan) - 1

    def blocked_split(self) -> dict[str, float]:
        """Seconds so far of the blocked time of sends and merges, by part: send (a send's
        time on the training thread), wait (merges waiting for their syncs), mix (the rest of
        the merges: settling the residual, the alpha mix, adopting the anchor)."""
        return {
            "send": self.send_seconds,
            "wait": self.merge_wait_seconds,
            "mix": self.merge_seconds - self.merge_wait_seconds,
        }

    def _covered(self, fragment: int, outcome: FragmentOutcome) -> None:
        # Units of a body the server did not fold ("committed": it took them into its open
        # round, in memory until that round commits) go again with a later report.
        reported = set(outcome.units) if outcome.folded else set()
        for unit in outcome.finished:
            if unit not in reported:
                self.covered.setdefault(unit, set()).add(fragment)
        for unit in reported:
            self.covered.pop(unit, None)
        self.units.reported(sorted(reported))

    def _wait(self, flight: InFlight) -> dict:
        """On rank 0: join the thread (bounded by fragment_timeout); say how it ended."""
        flight.thread.join(timeout=self.fragment_timeout)
        outcome = flight.outcome
        if flight.thread.is_alive():
            flight.cancel.set()  # it stops at its next retry or poll and is forgotten
            return self._failed(outcome, f"no result within {self.fragment_timeout:g} s")
        if outcome.error is not None:
            if isinstance(outcome.error, (ServerUnavailable, ClientClosed)):
                return self._failed(outcome, str(outcome.error))
            raise outcome.error
        if outcome.rebase_rounds is not None:
            return {
                "status": "rebase",
                "version": outcome.next_round,
                "fragment_rounds": outcome.rebase_rounds,
            }
        return {"status": "merged", "next_round": outcome.next_round, "round": outcome.round}

    @staticmethod
    def _failed(outcome: FragmentOutcome, why: str) -> dict:
        return {"status": "failed", "round": outcome.round, "error": why}

    def _mix(
        self,
        fragment: int,
        global_values: dict[str, torch.Tensor],
        received: dict[str, torch.Tensor],
    ) -> None:
        """theta = (1 - alpha) G' + alpha L on this rank; G' is the fragment's new anchor.
        Tensor by tensor: the mix of one tensor is made and copied in before the next, so
        the merge holds one tensor's temporary, not the whole fragment's (with alpha 0, the
        default, none: alpha_merge hands back G' itself, copied in once).
        `received`: G' as the sync's thread got it (rank 0; empty elsewhere), for the anchor."""
        state = self.anchor.model.state_dict()
        with torch.no_grad():
            for name in self.plan[fragment]:
                merged = alpha_merge({name: global_values[name]}, {name: state[name]}, self.alpha)
                state[name].copy_(merged[name])
        self.anchor.adopt_fragment(received)

    # ----------------------------------------------------------------- the end

    def flush(self) -> None:
        """At the end: merge what is in flight, then sync each fragment whose local values are
        not its global ones (trained since its last merge, or merged with alpha > 0), one at a
        time and without overlap, taking G' as it is: every worker ends on the global model."""
        if self.in_flight is not None:
            self.merge(self.in_flight.outcome.fragment)
        saved_alpha = self.alpha
        self.alpha = 0.0
        try:
            for fragment in range(len(self.plan)):
                if self.windows.trained_since_merge(fragment) or saved_alpha > 0:
                    self.send(fragment)
                    self.merge(fragment)
        finally:
            self.alpha = saved_alpha
