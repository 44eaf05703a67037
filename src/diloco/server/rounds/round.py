"""One round (of a fragment), or an async grace window: its barrier set, the submissions
folded in so far, and its timing; and `Submission`, one pseudo-gradient as the intake hands it
to a round engine."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from diloco.algorithm import Contribution, RunningMean
from diloco.server.members.membership import WorkerRecord
from diloco.server.state.step_inputs import InputCopy, discard_all
from diloco.wire import WireError
from diloco.wire.format.spool import CheckedPieces, Piece, PieceBody, sum_overflow


@dataclass(frozen=True)
class Submission:
    """Keyed by (worker, round, fragment); `units` are the work units it reports finished,
    `progress` those trained in part (unit -> samples of it trained so far)."""

    record: WorkerRecord
    round: int
    fragment: int
    tensors: Mapping[str, torch.Tensor] | PieceBody  # a compressed body: decoded pieces
    tokens: int
    units: list[int]
    progress: dict[int, int] = field(default_factory=dict)
    copy: InputCopy | None = None  # its body in the state dir, durable soon (step_inputs.py)

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def nbytes(self) -> int:
        if isinstance(self.tensors, PieceBody):
            return self.tensors.nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Round:
    """Round `number` collects pseudo-gradients until every member has submitted or left.

    `members` is the barrier set: the workers live when the round started. Submissions are
    folded into a running mean at once, so the server holds one fp32 model of sums, not K.
    """

    number: int
    members: set[str]
    weighting: str
    opened_at: float
    first_submission_at: float | None = None
    submitted: dict[tuple[str, int], float] = field(default_factory=dict)  # key -> when
    tokens: int = 0
    running: RunningMean | None = None
    units: dict[str, list[int]] = field(default_factory=dict)  # worker -> units it finished
    # worker -> {unit: samples of it trained so far}: prefixes recorded when the round commits
    progress: dict[str, dict[int, int]] = field(default_factory=dict)
    # Robust aggregation: submissions held (bodies kept) until the round decides at its
    # commit; then the norms it used, the scales below 1 it clipped to, the refusals.
    held: list[tuple[Submission, ValueScan]] = field(default_factory=list)
    norms: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    count_senders: bool = False  # --aggregation sparse_mean: each element's senders counted
    senders_storage: dict[str, torch.Tensor] | None = None  # (where the counts are written)
    # The copies of the bodies folded, in fold order, which its step's log adopts; None once
    # a body came without one (the step then logs its sums).
    inputs: list[InputCopy] | None = field(default_factory=list)

    def keep_input(self, submission: Submission, checked: bool) -> None:
        """A body was folded (`checked`: by a reader that checked it as it folded, not after
        a scan): its copy is the round's next input (see `inputs`)."""
        copy = submission.copy
        if self.inputs is None:
            return
        if copy is None:
            self.drop_inputs()
            return
        copy.owned = True
        copy.sender = (submission.worker_id, submission.round, submission.tokens)
        copy.checked = checked
        self.inputs.append(copy)

    def drop_inputs(self) -> None:
        """The step logs its sums, not its bodies: their copies go."""
        discard_all(self.inputs)
        self.inputs = None

    def units_of(self, worker_id: str) -> set[int]:
        """Units reported (finished or in part) with a submission in this round: they complete
        or advance when it commits, so an eviction must not lease them again before."""
        return set(self.units.get(worker_id, ())) | set(self.progress.get(worker_id, {}))

    def add_progress(self, worker_id: str, progress: dict[int, int]) -> None:
        """Partly trained units a worker reports with this round (the largest count wins)."""
        mine = self.progress.setdefault(worker_id, {})
        for unit_id, count in progress.items():
            mine[unit_id] = max(count, mine.get(unit_id, 0))

    def all_progress(self) -> dict[int, int]:
        """Every partly trained unit of the round and its prefix (finished units left out)."""
        finished = set(self.all_units())
        merged: dict[int, int] = {}
        for progress in self.progress.values():
            for unit_id, count in progress.items():
                if unit_id not in finished:
                    merged[unit_id] = max(count, merged.get(unit_id, 0))
        return dict(sorted(merged.items()))

    def progress_of_departed(self, live: Callable[[str], bool]) -> list[int]:
        """Partly trained units of workers no longer live: back to the pool at the commit."""
        finished = set(self.all_units())
        return sorted(
            unit_id
            for worker_id, progress in self.progress.items()
            if not live(worker_id)
            for unit_id in progress
            if unit_id not in finished
        )

    def add_units(self, worker_id: str, units: Iterable[int]) -> None:
        """Units a worker reports with this round (with a submission, or carried over from a
        submission that came after its round committed)."""
        self.units[worker_id] = sorted(set(self.units.get(worker_id, ())) | set(units))

    def all_units(self) -> list[int]:
        return sorted({unit for units in self.units.values() for unit in units})

    def has(self, worker_id: str, fragment: int) -> bool:
        return (worker_id, fragment) in self.submitted

    def open_sums(self, storage: dict[str, torch.Tensor]) -> None:
        """Start the running mean, its fp32 sums written over the tensors of `storage` (and
        its counts of senders over `senders_storage`'s)."""
        self.running = RunningMean(
            self.weighting,
            storage=storage,
            count_senders=self.count_senders,
            senders_storage=self.senders_storage,
        )

    def add(
        self,
        worker_id: str,
        fragment: int,
        contribution: Contribution,
        now: float,
        scale: float = 1.0,
        max_abs: float = math.inf,
        record: bool = True,
    ) -> None:
        """`scale` shrinks a stale async pseudo-gradient (or clips one); `max_abs` bounds its
        values; `record`: False for a held submission, recorded when it arrived."""
        self._running().add(contribution, scale=scale, max_abs=max_abs)
        if record:
            self._record(worker_id, fragment, contribution.tokens, now)

    def hold(self, submission: Submission, scan: ValueScan, now: float) -> None:
        """Keep a submission (and its body) to fold when the round decides (robust
        aggregation); it counts as submitted now."""
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.hold()  # the request's close() then leaves the file open
        self.held.append((submission, scan))
        self._record(submission.worker_id, submission.fragment, submission.tokens, now)

    def record_refused(self, submission: Submission, reason: str, now: float) -> None:
        """A submission screened out: it counts as submitted (its barrier place, its units)
        but adds nothing."""
        self.refused[submission.worker_id] = reason
        self._record(submission.worker_id, submission.fragment, submission.tokens, now)

    def add_pieces(
        self,
        worker_id: str,
        fragment: int,
        shapes: dict[str, tuple[int, ...]],
        pieces: Iterable[tuple[str, int, Piece]],
        tokens: int,
        now: float,
        scale: float = 1.0,
        max_abs: float | Callable[[], float] = math.inf,
        record: bool = True,
    ) -> None:
        """A contribution read back from disk a piece at a time (see wire.spool); `max_abs`
        bounds its values' magnitude (from the scan), so the round can know its sums finite."""
        self._running().add_pieces(shapes, pieces, tokens, scale=scale, max_abs=max_abs)
        if record:
            self._record(worker_id, fragment, tokens, now)

    def _running(self) -> RunningMean:
        if self.running is None:
            self.running = RunningMean(self.weighting)
        return self.running

    def _record(self, worker_id: str, fragment: int, tokens: int, now: float) -> None:
        self.submitted[(worker_id, fragment)] = now
        self.tokens += max(0, tokens)
        if self.first_submission_at is None:
            self.first_submission_at = now

    @property
    def contributions(self) -> int:
        return 0 if self.running is None else self.running.count

    @property
    def submitters(self) -> set[str]:
        return {worker for worker, _ in self.submitted}

    def waiting_for(self) -> list[str]:
        return sorted(self.members - self.submitters)

    def more_submissions_needed(self, min_workers: int) -> int:
        """Submissions `min_workers` asks for beyond what every member would bring: the round
        cannot commit until that many come from workers that join late (0 when its members
        suffice)."""
        return max(0, max(1, min_workers) - len(self.submitted) - len(self.waiting_for()))

    def leave(self, worker_id: str) -> None:
        """An evicted or departed member no longer holds the barrier."""
        self.members.discard(worker_id)

    def ready(self, min_workers: int) -> bool:
        """Every member is in, and enough submissions to make an outer step.

        Counts accepted submissions, not weighted contributions: under "tokens" weighting a
        submission with tokens <= 0 carries no weight, and a round whose every submission is
        weightless must still commit (changing nothing) instead of waiting forever.
        """
        return not self.waiting_for() and len(self.submitted) >= max(1, min_workers)

    def barrier_expired(self, now: float, timeout: float) -> bool:
        return self.first_submission_at is not None and now - self.first_submission_at > timeout


class FoldTorn(RuntimeError):
    """A body failed part way into sums that held other bodies already (a read error of its
    spool file, memory): they cannot be trusted or rolled back, so the server stops serving
    until a restart, which replays the durable steps and takes the round's bodies again."""


@dataclass(frozen=True)
class ValueScan:
    """What a scan of a body's values found: a bound of every magnitude (inf when unknown)
    and the tensor that set it."""

    bound: float
    largest: str | None = None
    norm: float | None = None  # L2 over the trainable float tensors (robust aggregation)


def fold(
    target: Round,
    submission: Submission,
    checked: CheckedPieces | ValueScan,
    storage: dict[str, torch.Tensor],
    now: float,
    scale: float = 1.0,
    record: bool = True,
) -> None:
    """Add a pseudo-gradient to a round's running mean (from RAM, or a piece at a time: a
    spooled body, a compressed one decoded span by span). `record`: False for a submission
    the round held (recorded as submitted when it arrived).

    `checked` is what the scan of its values found, or, when this fold opens the round's
    sums (written over `storage`), a reader that checks them as they are folded: its
    WireError then leaves the round as it was. Values that, weighted and added, could
    overflow the fp32 sums are refused (422 sum_overflow) before anything is folded, so a
    commit never meets a non-finite mean.
    """
    tensors = submission.tensors
    opened = target.running is None
    if opened:
        target.open_sums(storage)
    assert target.running is not None
    headroom = target.running.headroom(submission.tokens, scale)
    try:
        if isinstance(checked, CheckedPieces):
            checked.limit = headroom
        elif headroom is not None and checked.bound > headroom:
            raise sum_overflow(checked.largest or "?", checked.bound, headroom)
        if isinstance(tensors, PieceBody):
            shapes = {name: tuple(t.shape) for name, t in tensors.meta.items()}
            # top-k spans as their kept values where the sums add them as the dense fold would
            sparse = target.running.takes_sparse(submission.tokens, scale)
            if isinstance(checked, CheckedPieces):
                reader = checked
                reader.sparse = sparse
                pieces, max_abs = reader, (lambda: reader.bound)
            else:
                pieces, max_abs = tensors.pieces(sparse), checked.bound
            target.add_pieces(
                submission.worker_id,
                submission.fragment,
                shapes,
                pieces,
                submission.tokens,
                now,
                scale,
                max_abs,
                record,
            )
        else:
            bound = checked.bound if isinstance(checked, ValueScan) else math.inf
            contribution = Contribution(tensors, submission.tokens, submission.worker_id)
            target.add(
                submission.worker_id, submission.fragment, contribution, now, scale, bound, record
            )
    except WireError:  # a refusal before anything was folded, or by the first body's reader
        if opened:
            target.running = None
        raise
    except BaseException as exc:
        if opened:  # the sums held only this body: dropped, the round is as it was
            target.running = None
            raise
        # Part of the body may be in sums that hold others' too: only they can be logged
        # now, and they are not the round's any more (a resend would fold that part twice).
        target.drop_inputs()
        if isinstance(exc, Exception):
            raise FoldTorn(
                f"folding {submission.worker_id}'s pseudo-gradient into round "
                f"{target.number} failed part way ({type(exc).__name__}: {exc}): the round's "
                "sums may hold part of it"
            ) from exc
        raise
    target.keep_input(submission, isinstance(checked, CheckedPieces))
