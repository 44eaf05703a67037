"""Robust aggregation on the server: which pseudo-gradients a step uses, and how scaled.

Under every rule but `mean`, each pseudo-gradient's L2 norm (over its trainable float tensors,
taken when its values are scanned) is compared with the median of recent norms
(algorithm/robust.py): one more than `--outlier-ratio` times it is refused, and under
clipped_mean one more than `--clip-multiple` times it is scaled down to that bound. Under
trimmed_mean:F and median (sync and streaming, plain uploads) the kept ones are then combined
element by element, one tensor at a time (K copies of one tensor in memory, never of the
model), with algorithm/robust.py's `aggregate`, and the result is folded as the step's one
pseudo-gradient. In sync and streaming rounds, of the ones the norms keep (3 at least), any
whose cosine with the round's element-wise median is negative is refused too: a sign-flipped
update has an honest norm. Sync and streaming rounds hold their submissions (spooled on disk)
until the barrier is complete and decide for the whole round at once, as the simulator does;
async mode decides at each arrival, against the history and the open window. The history (per
fragment) advances only with a committed step and is written with it (the commit record in the
checkpoint), so a restart screens exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco.algorithm.robust import Aggregation, NormHistory, OpposedCheck, Screened, aggregate
from diloco.algorithm.tensors import TensorKind
from diloco.server.errors import Rejection
from diloco.server.rounds.round import FoldTorn, Round, Submission, ValueScan, fold
from diloco.wire import TensorSpec, WireError
from diloco.wire.compressed.pieces import CompressedPieces
from diloco.wire.format.spool import PieceBody, SpooledTensors

log = logging.getLogger("diloco.server")


class RobustScreen:
    """The aggregation rule and one norm history per fragment (one but in streaming mode)."""

    def __init__(self, aggregation: Aggregation, fragments: int) -> None:
        self.aggregation = aggregation
        self.histories = [NormHistory() for _ in range(fragments)]

    @property
    def on(self) -> bool:
        """Whether norms are screened at all (every rule but the plain mean)."""
        return self.aggregation.screens

    @property
    def elementwise(self) -> bool:
        """trimmed_mean or median: a round's pseudo-gradients combine element by element."""
        return self.aggregation.rule in ("trimmed_mean", "median")

    def verdict(self, fragment: int, norms: Sequence[float]) -> Screened:
        return self.histories[fragment].verdict(norms, self.aggregation)

    def snapshot(self) -> list[list[float]]:
        """Every fragment's remembered norms, for the commit record."""
        return [list(history.norms) for history in self.histories]

    def after(self, fragment: int, norms: Iterable[float]) -> list[list[float]]:
        """`snapshot` as it will be once a step of `fragment` that used `norms` commits."""
        histories = self.snapshot()
        kept = NormHistory(self.histories[fragment].norms.maxlen or 0, histories[fragment])
        kept.remember(norms)
        histories[fragment] = list(kept.norms)
        return histories

    def restore(self, histories: Sequence[Sequence[float]]) -> None:
        """The histories a checkpoint's commit record holds (fewer: the rest stay empty)."""
        for history, norms in zip(self.histories, histories, strict=False):
            history.norms.clear()
            history.norms.extend(float(n) for n in norms)


def screened_record(screen: RobustScreen, fragment: int, decided: Round) -> dict:
    """The commit record's robust-aggregation fields for a step of `fragment` that uses
    `decided`'s screened submissions: empty under the plain mean."""
    if not screen.on:
        return {}
    return {
        "norms": dict(decided.norms),
        "clipped": dict(decided.clipped),
        "refused": dict(decided.refused),
        "norm_history": screen.after(fragment, decided.norms.values()),
    }


def decide_round(
    screen: RobustScreen,
    current: Round,
    fragment: int,
    storage: dict[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    now: float,
) -> None:
    """Screen a complete round's held submissions as one (their norms against the median of
    recent ones, then their directions) and fold what they make into its sums (see
    `fold_screened`). Every held body is released."""
    held = sorted(current.held, key=lambda pair: pair[0].worker_id)
    norms = [scan.norm or 0.0 for _, scan in held]
    verdict = screen.verdict(fragment, norms)
    refused = dict(verdict.refused)
    kept = [i not in refused for i in range(len(held))]
    refused.update(opposed_refusals(opposed_sums(held, kept, specs), kept))
    fold_screened(screen, current, held, norms, verdict.scales, refused, storage, specs, now)
    current.held = []
    for submission, _ in held:
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.release()


def fold_screened(
    screen: RobustScreen,
    current: Round,
    held: Sequence[tuple[Submission, ValueScan]],
    norms: Sequence[float],
    scales: Sequence[float],
    refused: Mapping[int, str],
    storage: dict[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    now: float,
) -> None:
    """Fold `held` (in worker-id order) as a verdict says: the `refused` ones (by index) are
    recorded, each kept one folded with its scale (clipped_mean), or their element-wise
    combination (trimmed_mean, median); the round notes the kept ones' `norms` and the
    scales below 1. Sharded servers give the verdict shard 0 made from every shard's part
    (server/shards/sync_decisions.py); bodies stay held (the caller releases them)."""
    opened = current.running is None
    refused_before = dict(current.refused)  # a ban's drop (drop_held) stays recorded
    try:
        if current.running is None:
            current.open_sums(storage)
        kept: list[tuple[Submission, ValueScan, float]] = []
        for index, (submission, scan) in enumerate(held):
            if index in refused:
                current.refused[submission.worker_id] = refused[index]
            else:
                kept.append((submission, scan, scales[index]))
        if screen.elementwise:
            _fold_combined(screen.aggregation, current, kept, specs)
        else:
            for submission, scan, scale in kept:
                try:
                    fold(current, submission, scan, storage, now, scale, record=False)
                except WireError as error:  # its sum could overflow: refused, as an outlier
                    current.refused[submission.worker_id] = error.error
        for index, (submission, _) in enumerate(held):
            if index not in refused and submission.worker_id not in current.refused:
                current.norms[submission.worker_id] = float(norms[index])
                if scales[index] < 1.0:
                    current.clipped[submission.worker_id] = scales[index]
    except BaseException as exc:
        # A read that failed half way (a spool file cut short, an I/O error): the round goes
        # back to holding everything, with no sums, so that no later event commits a part.
        if opened:
            current.running = None
        current.norms.clear()
        current.clipped.clear()
        current.refused = refused_before
        if opened and isinstance(exc, FoldTorn) and exc.__cause__ is not None:
            raise exc.__cause__ from None  # (the sums it tore are gone: no reason to stop)
        raise
    for worker_id, reason in current.refused.items():
        log.warning("round %d: %s's pseudo-gradient refused: %s", current.number, worker_id, reason)


def opposed_sums(
    held: Sequence[tuple[Submission, ValueScan]],
    kept: Sequence[bool],
    specs: Mapping[str, TensorSpec],
) -> OpposedCheck:
    """`OpposedCheck`'s sums over the kept held bodies and the trained tensors of `specs`,
    read a tensor at a time (nothing is read when fewer than 3 are kept: no check)."""
    chosen = [i for i, keep in enumerate(kept) if keep]
    check = OpposedCheck(len(chosen))
    if len(chosen) < 3:
        return check
    for name, spec in specs.items():
        if spec.trained:
            check.add(torch.stack([_tensor(held[i][0].tensors, name, spec) for i in chosen]))
    return check


def opposed_refusals(check: OpposedCheck, kept: Sequence[bool]) -> dict[int, str]:
    """{index into the held list: reason} of the kept ones `check` refuses."""
    chosen = [i for i, keep in enumerate(kept) if keep]
    return {chosen[row]: reason for row, reason in check.refused().items()}


def _fold_combined(
    aggregation: Aggregation,
    current: Round,
    kept: Sequence[tuple[Submission, ValueScan, float]],
    specs: Mapping[str, TensorSpec],
) -> None:
    """Fold the element-wise combination of `kept` as one pseudo-gradient, a tensor at a time."""
    if not kept:
        return
    kinds = {name: TensorKind(spec.kind) for name, spec in specs.items()}
    scales = [scale for _, _, scale in kept]

    def combined() -> Iterator[tuple[str, int, torch.Tensor]]:
        for name, spec in specs.items():
            values = [{name: _tensor(s.tensors, name, spec)} for s, _, _ in kept]
            yield name, 0, aggregate(values, kinds, aggregation, scales)[name].reshape(-1)

    assert current.running is not None
    current.running.add_pieces(
        {name: tuple(spec.shape) for name, spec in specs.items()},
        combined(),
        sum(s.tokens for s, _, _ in kept),
        max_abs=max(scan.bound * scale for _, scan, scale in kept),
    )


def _tensor(body: object, name: str, spec: TensorSpec) -> torch.Tensor:
    """One tensor of a held body as fp32 (read from its spool file when it is one, decoded
    from its coded spans when it is a compressed upload)."""
    if isinstance(body, CompressedPieces):
        return body.tensor(name).view(spec.shape)
    if isinstance(body, SpooledTensors):
        out = torch.empty(int(torch.Size(spec.shape).numel()), dtype=torch.float32)
        for _, first, piece in body.pieces(names=[name]):
            out[first : first + piece.numel()].copy_(piece)
        return out.view(spec.shape)
    assert isinstance(body, Mapping)
    return body[name].to(torch.float32)


def drop_held(current: Round, worker_id: str, reason: str) -> bool:
    """Take a worker's held submission out of a round (an admin banned it): its barrier place
    stays, its pseudo-gradient is refused with `reason`. False if it held none."""
    mine = [pair for pair in current.held if pair[0].worker_id == worker_id]
    if not mine:
        return False
    current.held = [pair for pair in current.held if pair[0].worker_id != worker_id]
    current.refused[worker_id] = reason
    for submission, _ in mine:
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.release()
    return True


# Shard 0's decision of a step, who contributed: worker -> (the round it sent for, the
# session digest of the slices it used; None where the worker sent no session)
Contributors = dict[str, tuple[int, str | None]]


@dataclass(frozen=True)
class DecidedScales:
    """How shard 0's decision of a screened round used each contributor: its scale (0:
    refused, below 1: clipped) and its whole pseudo-gradient's norm."""

    scales: dict[str, float]
    norms: dict[str, float]

    def refused(self) -> dict[str, str]:
        """{worker: reason} of the contributors shard 0 refused (scale 0), for the record."""
        return {w: "refused by shard 0's screening" for w, s in self.scales.items() if s <= 0}


@dataclass(frozen=True)
class ScreeningPart:
    """A shard's part of the opposed check over the kept slices (worker -> session digest):
    each one's dot with the element-wise median, its squares, and the median's squares,
    over the shard's tensors."""

    kept: dict[str, str]
    dots: dict[str, float]
    squares: dict[str, float]
    median_squares: float
    # the kept workers whose slices the shard lacks (lost in a restart): no sums yet
    missing: tuple[str, ...] = ()


@dataclass
class Screening:
    """Shard 0's screening of a complete round under a robust rule (algorithm/robust.py), for
    every shard at once: each worker's norm is that of its whole pseudo-gradient (the squares
    of every shard's slice, summed at its confirmation), which keeps, refuses or clips it as
    one server's would; when 3 or more are kept, each shard adds its tensors' part of the
    opposed check's sums (sums over disjoint tensors add up to the whole model's)."""

    slices: tuple[tuple[str, str], ...]  # (worker, session digest) of each confirmed slice
    norms: list[float]
    scales: list[float]
    refused: dict[int, str]  # by the norms, by index into `slices`
    check: OpposedCheck  # the kept ones' sums so far, in worker-id order
    answered: set[int]  # the shards whose part of the check is in
    # shard -> the kept workers whose slices it lacks (their result poll on shard 0 tells
    # them to send their slices again)
    missing: dict[int, set[str]] = field(default_factory=dict)

    @property
    def kept(self) -> list[bool]:
        return [index not in self.refused for index in range(len(self.slices))]

    @property
    def checks(self) -> bool:
        """Whether the opposed check runs (3 or more kept: with 2 the median is their mean)."""
        return sum(self.kept) >= 3

    def kept_slices(self) -> dict[str, str]:
        """worker -> session digest of the kept ones: what every shard's part is summed over."""
        return {w: d for (w, d), keep in zip(self.slices, self.kept, strict=True) if keep}

    def complete(self, shards: int) -> bool:
        return not self.checks or len(self.answered) >= shards

    def verdict(self) -> dict[int, str]:
        """Every refusal, by index: the norms', then the opposed check's (once complete)."""
        refused = dict(self.refused)
        if self.checks:
            refused.update(opposed_refusals(self.check, self.kept))
        return refused

    def take_part(self, shard: int, part: ScreeningPart) -> bool:
        """Another shard's part of the opposed check (its sums over the kept slices it
        holds), or the kept slices it lacks; whether its sums are news. 409
        `screening_changed` for a part over other slices, 422 for a malformed one (nothing
        changed)."""
        mine = self.kept_slices()
        if not self.checks or dict(part.kept) != mine:
            raise Rejection(
                409,
                "screening_changed",
                "the round is not screening these slices (it changed since they were asked "
                "for); ask for its decision again",
                kept=mine if self.checks else {},
            )
        if part.missing:
            if not set(part.missing) <= set(mine):
                raise Rejection(
                    422,
                    "invalid_request",
                    "field 'missing' must name kept workers only",
                    field="missing",
                    expected=sorted(mine),
                )
            if shard not in self.answered:
                self.missing[shard] = set(part.missing)
            return False
        for name, given in (("dots", part.dots), ("squares", part.squares)):
            if set(given) != set(mine):
                raise Rejection(
                    422,
                    "invalid_request",
                    f"field '{name}' must name exactly the kept workers",
                    field=name,
                    expected=sorted(mine),
                )
        if shard in self.answered:
            return False
        order = sorted(mine)
        self.check.absorb(
            [part.dots[w] for w in order], [part.squares[w] for w in order], part.median_squares
        )
        self.answered.add(shard)
        self.missing.pop(shard, None)
        return True

    def lacking(self, worker_id: str) -> list[int]:
        """The shards that said they lack `worker_id`'s kept slice (sorted)."""
        return sorted(shard for shard, workers in self.missing.items() if worker_id in workers)
