"""Robust aggregation of one round's pseudo-gradients against bad or hostile workers.

`mean` is DiLoCo's plain average. The robust rules screen first: the norm of each
pseudo-gradient (L2 over the trainable tensors) is compared with a reference, the median of
the norms of recent accepted pseudo-gradients and of this round's; one more than
`outlier_ratio` times the reference is refused, with its reason. What is left is combined by

  - `clipped_mean`: each pseudo-gradient scaled by min(1, clip_multiple x reference / norm),
    then averaged (norm bounding, as in Sun et al. 2019, "Can You Really Backdoor Federated
    Learning?", with a median reference so that one worker cannot move the bound);
  - `trimmed_mean:F`: per element, the floor(F K) largest and floor(F K) smallest of the K
    values dropped and the rest averaged (Yin et al. 2018, "Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates"); F in [0, 0.5);
  - `median`: the per-element median (the same paper); for an even K the mean of the two
    middle values, so that K = 2 is the plain mean.

`sparse_mean` is not a robust rule (it screens nothing): per element, the mean over the
contributions that sent it (a value other than 0), 0 where none did. SparseLoCo (Sarfi et
al. 2025) averages top-k uploads this way (its code's `scatter_reduce(reduce="mean",
include_self=False)`), where the plain mean divides a value only one of K workers kept by K.

Buffers, frozen and integer tensors are not trained by the outer optimizer: they take the
mean of the accepted contributions under every rule (each scaled as its contribution is, so
that a clipped worker moves them no more than it moves the weights). Uniform weights only: a
token count is a claim the worker makes, and a hostile one could claim any.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.algorithm._checks import require_positive
from diloco.algorithm.tensors import TensorDict, TensorKind

AGGREGATIONS = ("mean", "clipped_mean", "trimmed_mean", "median", "sparse_mean")
DEFAULT_CLIP_MULTIPLE = 2.0
DEFAULT_OUTLIER_RATIO = 10.0
NORM_HISTORY = 32  # accepted norms the reference remembers


@dataclass(frozen=True)
class Aggregation:
    """One rule and its settings; `parse` reads `--aggregation` text."""

    rule: str = "mean"
    trim: float = 0.0  # trimmed_mean's F
    clip_multiple: float = DEFAULT_CLIP_MULTIPLE
    outlier_ratio: float = DEFAULT_OUTLIER_RATIO

    @classmethod
    def parse(
        cls,
        text: str,
        clip_multiple: float = DEFAULT_CLIP_MULTIPLE,
        outlier_ratio: float = DEFAULT_OUTLIER_RATIO,
    ) -> Aggregation:
        """`mean`, `clipped_mean`, `trimmed_mean:F` (0 <= F < 0.5), `median` or
        `sparse_mean`."""
        rule, _, argument = str(text).partition(":")
        if rule not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of mean, clipped_mean, trimmed_mean:F, median, "
                f"sparse_mean; got {text!r}"
            )
        trim = 0.0
        if rule == "trimmed_mean":
            try:
                trim = float(argument)
            except ValueError:
                raise ValueError(
                    f"trimmed_mean takes its trimmed fraction F as trimmed_mean:F with "
                    f"0 <= F < 0.5, got {text!r}"
                ) from None
            if not (math.isfinite(trim) and 0 <= trim < 0.5):
                raise ValueError(f"the trimmed fraction F must be in [0, 0.5), got {argument}")
        elif argument:
            raise ValueError(f"aggregation {rule} takes no argument, got {text!r}")
        require_positive("clip multiple", clip_multiple)
        if not (isinstance(outlier_ratio, (int, float)) and outlier_ratio > 1):
            raise ValueError(f"outlier ratio must be > 1, got {outlier_ratio!r}")
        return cls(rule, trim, float(clip_multiple), float(outlier_ratio))

    def __str__(self) -> str:
        return f"trimmed_mean:{self.trim:g}" if self.rule == "trimmed_mean" else self.rule

    @property
    def screens(self) -> bool:
        """Whether norms are compared at all (every rule but the plain and sparse means)."""
        return self.rule not in ("mean", "sparse_mean")


def trained(kinds: Mapping[str, TensorKind], name: str, tensor: torch.Tensor) -> bool:
    """Whether the outer optimizer steps `name` (trainable and floating): what the rules
    measure and combine; the rest take the mean."""
    return kinds.get(name) is TensorKind.TRAINABLE and tensor.is_floating_point()


def update_norm(gradient: Mapping[str, torch.Tensor], kinds: Mapping[str, TensorKind]) -> float:
    """The L2 norm of a pseudo-gradient over its trainable floating tensors (fp64 sum)."""
    total = 0.0
    for name, tensor in gradient.items():
        if trained(kinds, name, tensor):
            total += float(tensor.double().pow(2).sum())
    return math.sqrt(total)


@dataclass(frozen=True)
class Screened:
    """The round's verdict: a scale per contribution (0 for a refused one) and the reasons."""

    scales: list[float]
    refused: dict[int, str]
    reference: float | None


class NormHistory:
    """The norms of the last accepted pseudo-gradients, the reference's memory."""

    def __init__(self, size: int = NORM_HISTORY, norms: Iterable[float] = ()) -> None:
        self.norms: deque[float] = deque(norms, maxlen=size)

    def reference(self, current: Sequence[float]) -> float | None:
        """The median of the remembered norms and `current` (None with nothing to go on)."""
        pool = [*self.norms, *current]
        return statistics.median(pool) if pool else None

    def verdict(self, norms: Sequence[float], aggregation: Aggregation) -> Screened:
        """Which of one round's pseudo-gradients (their `norms`) are refused as outliers and,
        under clipped_mean, how much each of the rest is scaled; remembers nothing."""
        scales = [1.0] * len(norms)
        refused: dict[int, str] = {}
        if not aggregation.screens:
            return Screened(scales, refused, None)
        reference = self.reference(norms)
        if reference is not None and reference > 0:
            limit = aggregation.outlier_ratio * reference
            for index, norm in enumerate(norms):
                if not math.isfinite(norm) or norm > limit:
                    scales[index] = 0.0
                    refused[index] = (
                        f"pseudo-gradient norm {norm:.4g} is more than "
                        f"{aggregation.outlier_ratio:g}x the median norm {reference:.4g}"
                    )
                elif aggregation.rule == "clipped_mean":
                    bound = aggregation.clip_multiple * reference
                    scales[index] = min(1.0, bound / norm) if norm > 0 else 1.0
        return Screened(scales, refused, reference)

    def remember(self, norms: Iterable[float]) -> None:
        """The norms of pseudo-gradients a step used (not the refused ones)."""
        self.norms.extend(norms)


def aggregate(
    gradients: Sequence[Mapping[str, torch.Tensor]],
    kinds: Mapping[str, TensorKind],
    aggregation: Aggregation,
    scales: Sequence[float] | None = None,
) -> TensorDict:
    """The round's combined pseudo-gradient (fp32) from the contributions whose scale is > 0.

    Every contribution must carry the same names (a sync round, or one streaming fragment).
    """
    scales = list(scales) if scales is not None else [1.0] * len(gradients)
    kept = [(g, s) for g, s in zip(gradients, scales, strict=True) if s > 0]
    if not kept:
        return {}
    names = list(kept[0][0])
    combined: TensorDict = {}
    for name in names:
        values = [g[name].to(torch.float32) * s for g, s in kept]
        trainable = trained(kinds, name, values[0])
        if not trainable or aggregation.rule in ("mean", "clipped_mean"):
            combined[name] = torch.stack(values).mean(dim=0)
        elif aggregation.rule == "sparse_mean":
            stacked = torch.stack(values)
            senders = (stacked != 0).sum(dim=0).clamp(min=1)
            combined[name] = stacked.sum(dim=0) / senders
        elif aggregation.rule == "median":
            combined[name] = _median(torch.stack(values))
        else:
            combined[name] = _trimmed_mean(torch.stack(values), aggregation.trim)
    return combined


def _median(stacked: torch.Tensor) -> torch.Tensor:
    """Per-element median over dim 0; the mean of the two middle values for an even count."""
    ordered = stacked.sort(dim=0).values
    count = ordered.shape[0]
    if count % 2:
        return ordered[count // 2].clone()
    return (ordered[count // 2 - 1] + ordered[count // 2]) / 2


def _trimmed_mean(stacked: torch.Tensor, trim: float) -> torch.Tensor:
    """Per-element mean of the values left after dropping floor(trim K) from each end."""
    count = stacked.shape[0]
    cut = math.floor(trim * count)
    if cut == 0:
        return stacked.mean(dim=0)
    ordered = stacked.sort(dim=0).values
    return ordered[cut : count - cut].mean(dim=0)


class OpposedCheck:
    """Each pseudo-gradient's cosine with the round's element-wise median, accumulated a
    tensor at a time (over the trainable float tensors): one below 0 points away from where
    the others go. A sign-flipped update has the norm of an honest one, so no norm bound sees
    it; this does (FLTrust, Cao et al. 2021, scores updates by their cosine with a trusted
    direction; here the trusted direction is the round's median, so no data is needed)."""

    def __init__(self, count: int) -> None:
        self.dots = [0.0] * count
        self.squares = [0.0] * count
        self.median_squares = 0.0

    def add(self, stacked: torch.Tensor) -> None:
        """One tensor of every pseudo-gradient, stacked along dim 0 in a fixed order."""
        values = stacked.to(torch.float64)
        median = _median(values)
        self.median_squares += float(median.pow(2).sum())
        # (reshape, not flatten(1): a scalar tensor stacks to one dimension)
        flat, reference = values.reshape(values.shape[0], -1), median.flatten()
        for row in range(values.shape[0]):
            self.dots[row] += float(flat[row] @ reference)
            self.squares[row] += float(flat[row] @ flat[row])

    def absorb(
        self, dots: Sequence[float], squares: Sequence[float], median_squares: float
    ) -> None:
        """Add another part of the same rows' sums: what a shard holding other tensors of
        the same pseudo-gradients found (sharded servers: server/shards/sync_decisions.py).
        Sums over disjoint tensors add, so the parts make the whole model's cosine."""
        if len(dots) != len(self.dots) or len(squares) != len(self.squares):
            raise ValueError(
                f"a part of the check has {len(dots)} dots and {len(squares)} squares, "
                f"the check {len(self.dots)} rows"
            )
        self.dots = [a + float(b) for a, b in zip(self.dots, dots, strict=True)]
        self.squares = [a + float(b) for a, b in zip(self.squares, squares, strict=True)]
        self.median_squares += float(median_squares)

    def refused(self) -> dict[int, str]:
        """{row: reason} of the pseudo-gradients with a negative cosine (none when fewer than
        3 were given: with 2 the median is their mean)."""
        if len(self.dots) < 3:
            return {}
        refused = {}
        for row, (dot, squares) in enumerate(zip(self.dots, self.squares, strict=True)):
            scale = math.sqrt(squares * self.median_squares)
            cosine = dot / scale if scale > 0 else 0.0
            if cosine < 0:
                refused[row] = (
                    "pseudo-gradient points away from the round's median direction "
                    f"(cosine {cosine:.3f})"
                )
        return refused


def opposed(
    gradients: Sequence[Mapping[str, torch.Tensor]],
    kinds: Mapping[str, TensorKind],
    kept: Sequence[bool],
) -> dict[int, str]:
    """`OpposedCheck` over the kept ones of a round held in memory: {index: reason}."""
    chosen = [i for i, keep in enumerate(kept) if keep]
    check = OpposedCheck(len(chosen))
    if len(chosen) >= 3:
        for name, tensor in gradients[chosen[0]].items():
            if trained(kinds, name, tensor):
                check.add(torch.stack([gradients[i][name] for i in chosen]))
    return {chosen[row]: reason for row, reason in check.refused().items()}
