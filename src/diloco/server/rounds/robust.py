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

import torch

from diloco.algorithm.robust import Aggregation, NormHistory, OpposedCheck, Screened, aggregate
from diloco.algorithm.tensors import TensorKind
from diloco.server.rounds.round import Round, Submission, ValueScan, fold
from diloco.wire import TensorSpec, WireError
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
    recent ones) and fold what they make into its sums: each kept one with its scale
    (clipped_mean), or their element-wise combination (trimmed_mean, median). In worker-id
    order, so that the sums do not depend on arrival order. Every held body is released."""
    held = sorted(current.held, key=lambda pair: pair[0].worker_id)
    opened = current.running is None
    refused_before = dict(current.refused)  # a ban's drop (drop_held) stays recorded
    try:
        verdict = screen.verdict(fragment, [scan.norm or 0.0 for _, scan in held])
        if current.running is None:
            current.open_sums(storage)
        refused = dict(verdict.refused)
        refused.update(_opposed(held, [i not in refused for i in range(len(held))], specs))
        kept: list[tuple[Submission, ValueScan, float]] = []
        for index, (submission, scan) in enumerate(held):
            if index in refused:
                current.refused[submission.worker_id] = refused[index]
            else:
                kept.append((submission, scan, verdict.scales[index]))
        if screen.elementwise:
            _fold_combined(screen.aggregation, current, kept, specs)
        else:
            for submission, scan, scale in kept:
                try:
                    fold(current, submission, scan, storage, now, scale, record=False)
                except WireError as error:  # its sum could overflow: refused, as an outlier
                    current.refused[submission.worker_id] = error.error
        for submission, scan, scale in kept:
            if submission.worker_id not in current.refused:
                current.norms[submission.worker_id] = float(scan.norm or 0.0)
                if scale < 1.0:
                    current.clipped[submission.worker_id] = scale
    except BaseException:
        # A read that failed half way (a spool file cut short, an I/O error): the round goes
        # back to holding everything, with no sums, so that no later event commits a part.
        if opened:
            current.running = None
        current.norms.clear()
        current.clipped.clear()
        current.refused = refused_before
        raise
    current.held = []
    for submission, _ in held:
        if isinstance(submission.tensors, PieceBody):
            submission.tensors.release()
    for worker_id, reason in current.refused.items():
        log.warning("round %d: %s's pseudo-gradient refused: %s", current.number, worker_id, reason)


def _opposed(
    held: Sequence[tuple[Submission, ValueScan]],
    kept: Sequence[bool],
    specs: Mapping[str, TensorSpec],
) -> dict[int, str]:
    """`OpposedCheck` over the kept held bodies, read a tensor at a time: {index: reason}."""
    chosen = [i for i, keep in enumerate(kept) if keep]
    check = OpposedCheck(len(chosen))
    if len(chosen) < 3:
        return {}
    for name, spec in specs.items():
        if spec.trained:
            check.add(torch.stack([_tensor(held[i][0].tensors, name, spec) for i in chosen]))
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
    """One tensor of a held body as fp32 (read from its spool file when it is one)."""
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
