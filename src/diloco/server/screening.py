"""Robust aggregation on the server: which pseudo-gradients a step uses, and how scaled.

Under `--aggregation clipped_mean` every pseudo-gradient's L2 norm (over its trainable float
tensors, taken when its values are scanned) is compared with the median of recent norms
(algorithm/robust.py): one more than `--outlier-ratio` times it is refused, one more than
`--clip-multiple` times it is scaled down to that bound. Sync and streaming rounds hold their
submissions (spooled on disk) until the barrier is complete and decide for the whole round at
once, as the simulator does; async mode decides at each arrival, against the history and the
open window. The history (per fragment) advances only with a committed step and is written
with it (the commit record in the checkpoint), so a restart screens exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from diloco.algorithm.robust import Aggregation, NormHistory, Screened
from diloco.server.rounds import Round


class RobustScreen:
    """The aggregation rule and one norm history per fragment (one but in streaming mode)."""

    def __init__(self, aggregation: Aggregation, fragments: int) -> None:
        self.aggregation = aggregation
        self.histories = [NormHistory() for _ in range(fragments)]

    @property
    def on(self) -> bool:
        """Whether norms are screened at all (every rule but the plain mean)."""
        return self.aggregation.screens

    def verdict(self, fragment: int, norms: Sequence[float]) -> Screened:
        return self.histories[fragment].verdict(norms, self.aggregation)

    def remember(self, fragment: int, norms: Iterable[float]) -> None:
        self.histories[fragment].remember(norms)

    def snapshot(self) -> list[list[float]]:
        """Every fragment's remembered norms, for the commit record."""
        return [list(history.norms) for history in self.histories]

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
    after = RobustScreen(screen.aggregation, len(screen.histories))
    after.restore(screen.snapshot())
    after.remember(fragment, decided.norms.values())
    return {
        "norms": dict(decided.norms),
        "clipped": dict(decided.clipped),
        "refused": dict(decided.refused),
        "norm_history": after.snapshot(),
    }
