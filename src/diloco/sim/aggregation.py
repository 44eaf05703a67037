"""How the simulated server combines a sync round, and what a bad worker sends instead.

`--aggregation mean` is `outer_step`'s plain mean, as before; `sparse_mean` averages each
element over the workers that sent it (SparseLoCo's aggregation of top-k uploads). A robust
rule screens the round's norms against the norm history and refuses what points away from the
round's median (algorithm/robust.py), combines what is left with the rule, and applies it with
`apply_mean`, as the server's commit does. `--hostile` makes the last worker send its
pseudo-gradient corrupted (sim/hostile.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diloco.algorithm import Contribution, OuterOptimizer, TensorKind, apply_mean, outer_step
from diloco.algorithm.robust import Aggregation, NormHistory, aggregate, opposed, update_norm
from diloco.sim.hostile import corrupt

HOSTILE_SEED_OFFSET = 7919  # the bad worker's noise has a stream of its own


class SyncAggregation:
    """One run's rule, its norm history, the refusals so far, and the bad worker."""

    def __init__(self, rule: str, hostile: str, workers: int, seed: int) -> None:
        self.rule = Aggregation.parse(rule)
        self.history = NormHistory()
        self.refused = 0
        self.hostile = hostile
        self.bad_worker = workers - 1 if hostile != "none" else None
        self.generator = torch.Generator().manual_seed(seed + HOSTILE_SEED_OFFSET)

    def sent(
        self, worker: int, gradient: dict[str, torch.Tensor], kinds: Mapping[str, TensorKind]
    ) -> dict[str, torch.Tensor]:
        """What `worker` uploads for `gradient`: itself, or the bad worker's corruption."""
        if worker != self.bad_worker:
            return gradient
        return corrupt(gradient, self.hostile, kinds, self.generator)

    def apply(
        self,
        masters: dict[str, torch.Tensor],
        contributions: Sequence[Contribution],
        optimizer: OuterOptimizer,
        kinds: Mapping[str, TensorKind],
    ) -> None:
        """One outer step on the round's contributions under the rule."""
        if self.rule.rule == "sparse_mean":  # each element over the workers that sent it
            gradients = [c.pseudo_gradient for c in contributions]
            apply_mean(masters, aggregate(gradients, kinds, self.rule), optimizer, kinds)
            return
        if not self.rule.screens:
            outer_step(masters, contributions, optimizer, kinds)
            return
        gradients = [c.pseudo_gradient for c in contributions]
        norms = [update_norm(g, kinds) for g in gradients]
        screened = self.history.verdict(norms, self.rule)
        scales = list(screened.scales)
        away = opposed(gradients, kinds, [s > 0 for s in scales])
        for index in away:
            scales[index] = 0.0
        self.history.remember(n for n, scale in zip(norms, scales, strict=True) if scale > 0)
        self.refused += len(screened.refused) + len(away)
        combined = aggregate(gradients, kinds, self.rule, scales)
        if combined:
            apply_mean(masters, combined, optimizer, kinds)
