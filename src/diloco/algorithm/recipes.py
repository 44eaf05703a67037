"""The outer optimizer that goes with an upload codec, and what other combinations measured.

Top-k codecs (sparse) follow SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): the workers'
error-feedback accumulator e <- beta e + Delta already plays the part of outer momentum, so the
outer step is plain SGD, theta <- theta - alpha * mean(sent), with alpha = 1, and the mean of
each element is over the workers that sent it (aggregation sparse_mean). Every other codec
keeps DiLoCo's outer Nesterov, lr 0.7, momentum 0.9 and the plain mean (the quantizers cost
within +0.1 % of fp32 there). `outer_defaults` says which; a setting the user gives is always
kept (the server's and the simulator's settings resolve each of optimizer, lr, momentum and
aggregation on their own).

`MEASURED_COSTS` holds our measurements of these combinations, each with the file it comes
from; `outer_warnings` turns those over `WARN_ABOVE_PERCENT` into one sentence each. A
combination is warned about, never refused: researchers may want it. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.algorithm.compression.codecs import Codec, parse_codec

TOPK_RESULTS = "benchmarks/results/compression-topk/README.md"
COMPRESSION_RESULTS = "benchmarks/results/compression.md"
WARN_ABOVE_PERCENT = 5.0  # a measured cost above this (final eval loss vs fp32 DiLoCo) warns


@dataclass(frozen=True)
class OuterDefaults:
    """The outer optimizer a codec's run starts with when the user names none."""

    optimizer: str
    lr: float
    momentum: float
    aggregation: str
    why: str

    def __str__(self) -> str:
        momentum = "" if self.optimizer == "sgd" else f" momentum {self.momentum:g}"
        return f"{self.optimizer} lr {self.lr:g}{momentum}, {self.aggregation} ({self.why})"


DENSE_DEFAULTS = OuterDefaults("nesterov", 0.7, 0.9, "mean", "DiLoCo's outer Nesterov")
SPARSE_DEFAULTS = OuterDefaults(
    "sgd",
    1.0,
    0.0,
    "sparse_mean",
    "SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706: for a top-k codec the workers' "
    "error-feedback accumulator stands in for outer momentum, and each element is averaged "
    "over the workers that sent it",
)


def outer_defaults(upload_codec: Codec | str) -> OuterDefaults:
    """Top-k codecs: sgd, lr 1.0, no momentum, sparse_mean (SparseLoCo); any other codec:
    nesterov, lr 0.7, momentum 0.9, the plain mean. `upload_codec` is a Codec or its spec
    ("topk:0.03+int2")."""
    return SPARSE_DEFAULTS if _codec(upload_codec).is_sparse else DENSE_DEFAULTS


def resolve_aggregation(
    defaults: OuterDefaults, aggregation: str | None, uniform_rounds: bool, codec: Codec | str
) -> tuple[str, bool]:
    """The aggregation rule, and whether the codec chose it. A rule given is kept; none given
    is the plain mean, unless the codec picks another (top-k: sparse_mean) and the run averages
    rounds of workers with uniform weights (`uniform_rounds`, which sparse_mean needs) and
    the codec's values have no zero level for a kept value to fall on (`aggregation_conflict`). Only
    that pick counts as the codec's choice: the plain mean is every run's rule, and what a
    top-k codec costs under it the codec's warning says."""
    if aggregation is not None:
        return aggregation, False
    if defaults.aggregation == "mean" or not uniform_rounds:
        return "mean", False
    if aggregation_conflict(codec, defaults.aggregation) is not None:
        return "mean", False  # top-k with int8/int4 values: see aggregation_conflict
    return defaults.aggregation, True


@dataclass(frozen=True)
class ResolvedOuter:
    """An outer optimizer's settings once each one not given took the codec's default;
    `chosen` names those the codec chose (outer_optimizer, outer_lr, outer_momentum)."""

    optimizer: str
    lr: float
    momentum: float
    chosen: tuple[str, ...]


def resolve_outer(
    defaults: OuterDefaults,
    codec_name: str,
    optimizer: str | None,
    lr: float | None,
    momentum: float | None,
    plain_momentum: float,
) -> ResolvedOuter:
    """Each of `optimizer`, `lr`, `momentum` that is None takes `defaults`' (the server's and
    the simulator's settings share this). A momentum not given follows the codec only when
    the codec also chose the optimizer; under an optimizer the user named it is that
    optimizer's own (0 for sgd, else `plain_momentum`). A momentum given against the
    codec's sgd is a ValueError: sgd has none."""
    given = {"outer_optimizer": optimizer, "outer_lr": lr}
    chosen = [name for name, value in given.items() if value is None]
    optimizer = defaults.optimizer if optimizer is None else optimizer
    lr = defaults.lr if lr is None else lr
    if momentum is None:
        if "outer_optimizer" in chosen:
            chosen.append("outer_momentum")
            momentum = defaults.momentum
        else:  # the optimizer the user named, with its own momentum
            momentum = 0.0 if optimizer == "sgd" else plain_momentum
    elif "outer_optimizer" in chosen and optimizer == "sgd" and momentum:
        raise ValueError(
            f"outer_momentum {momentum!r} needs outer_optimizer momentum or nesterov: upload "
            f"codec {codec_name} picks outer sgd, which has no momentum (SparseLoCo: the "
            "workers' error feedback stands in for it)"
        )
    return ResolvedOuter(optimizer, lr, momentum, tuple(chosen))


@dataclass(frozen=True)
class MeasuredCost:
    """One measured run: its final eval loss above the best fp32 DiLoCo run's at the same H
    (of the outer lrs its results file ran), in percent."""

    upload_codec: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    sync_every: int
    topk_chunk: int | None  # None: a dense codec
    percent: float
    setup: str  # the model and the run, in words
    source: str  # the results file, from the repository root

    @property
    def sparse(self) -> bool:
        return self.topk_chunk is not None


_TOPK_SETUP = "137k-parameter GPT, K = 4, 5000 inner steps, EF 0.95"
_QUANT_SETUP = "237k-parameter GPT, K = 4, 1200 inner steps, EF 0.95"
MEASURED_COSTS: tuple[MeasuredCost, ...] = (
    MeasuredCost("topk:0.03+int2", "nesterov", 1.0, 0.9, 50, 128, 39.0, _TOPK_SETUP, TOPK_RESULTS),
    MeasuredCost("topk:0.03+int2", "nesterov", 1.0, 0.9, 50, 4096, 26.9, _TOPK_SETUP, TOPK_RESULTS),
    MeasuredCost("topk:0.03+int2", "sgd", 1.0, 0.0, 50, 128, 12.2, _TOPK_SETUP, TOPK_RESULTS),
    MeasuredCost("topk:0.03+int2", "sgd", 1.0, 0.0, 50, 4096, 11.3, _TOPK_SETUP, TOPK_RESULTS),
    MeasuredCost("topk:0.03+int2", "sgd", 1.0, 0.0, 10, 4096, 6.8, _TOPK_SETUP, TOPK_RESULTS),
    MeasuredCost("bf16", "nesterov", 0.7, 0.9, 50, None, -0.0, _QUANT_SETUP, COMPRESSION_RESULTS),
    MeasuredCost("int8", "nesterov", 0.7, 0.9, 50, None, -0.01, _QUANT_SETUP, COMPRESSION_RESULTS),
    MeasuredCost("int4", "nesterov", 0.7, 0.9, 50, None, 0.0, _QUANT_SETUP, COMPRESSION_RESULTS),
    MeasuredCost("int2", "nesterov", 0.7, 0.9, 50, None, 0.10, _QUANT_SETUP, COMPRESSION_RESULTS),
)


# Top-k at its companion settings with SparseLoCo's aggregation, the mean over each element's
# senders (--aggregation sparse_mean): (H, percent above the best fp32 DiLoCo run at that H),
# the same runs (chunks of 4096) and baselines as the plain mean's companion rows above.
SPARSE_MEAN_COSTS = ((50, 4.3), (10, -0.8))


@dataclass(frozen=True)
class DefaultCost:
    """topk:0.03+int2 at every default (outer sgd lr 1, sparse_mean, EF 0.95) but its chunk:
    final eval loss against fp32 DiLoCo's at its own defaults (outer nesterov lr 0.7) with the
    same tokens, in percent. (At 137k with 100 outer steps fp32's best outer lr, 1.0, ended
    lower: against it the chunk-4096 run is +4.3 % (SPARSE_MEAN_COSTS) and the chunk-128 run
    +6.7 %; at 200 outer steps and at 503k fp32's defaults were its best.)"""

    parameters: str  # the bundled GPT's size, in words
    sync_every: int
    outer_steps: int
    topk_chunk: int
    percent: float


# From TOPK_RESULTS and compression-defaults/ (K = 4, Shakespeare, seed 0). The gap shrinks as
# the model grows, so a small model's figure warns and the larger ones say where it goes.
DEFAULT_COSTS: tuple[DefaultCost, ...] = (
    DefaultCost("137k", 50, 100, 128, 5.2),
    DefaultCost("137k", 50, 200, 128, 5.4),
    DefaultCost("503k", 50, 200, 128, 1.8),
    DefaultCost("4.9M", 15, 200, 128, -1.9),
    DefaultCost("137k", 50, 100, 4096, 2.8),
    DefaultCost("137k", 50, 200, 4096, 2.4),
    DefaultCost("503k", 50, 200, 4096, 1.6),
    DefaultCost("4.9M", 15, 200, 4096, -1.6),
)
DEFAULTS_RESULTS = "benchmarks/results/compression-defaults/README.md"


def outer_warnings(
    upload_codec: Codec | str, optimizer: str, momentum: float, aggregation: str = "mean"
) -> list[str]:
    """One sentence per measured cost over WARN_ABOVE_PERCENT that this combination risks.

    Measured so: top-k with outer momentum (nesterov or momentum with momentum > 0), top-k at
    its own companion settings (outer sgd) under the plain mean, and top-k at all its defaults
    (sparse_mean) with chunks of 128, which cost +5.2 % to +5.4 % at 137k parameters
    (DEFAULT_COSTS: its warning also names the larger models' smaller costs); with chunks of
    4096 it cost at most +2.8 % and warns nothing. The quantizers (bf16, int8, int4, int2)
    cost within +0.1 % at nesterov 0.7 and warn nothing; combinations nobody measured warn
    nothing.
    """
    codec = _codec(upload_codec)
    with_momentum = optimizer != "sgd" and momentum > 0
    if codec.is_sparse and not with_momentum and aggregation == "sparse_mean":
        return _default_warnings(codec)
    rows = [
        row
        for row in MEASURED_COSTS
        if row.sparse == codec.is_sparse and (row.outer_momentum > 0) == with_momentum
    ]
    if not any(row.percent > WARN_ABOVE_PERCENT for row in rows):
        return []
    first = rows[0]
    if with_momentum:
        chunks = " and ".join(str(row.topk_chunk) for row in rows)
        return [
            f"upload codec {codec} with outer {optimizer} momentum {momentum:g}: top-k with "
            f"outer momentum ended {_span(rows)} above the best fp32 DiLoCo run at that H in "
            "our runs "
            f"({first.upload_codec}, H = {first.sync_every}, chunks {chunks}; {first.setup}; "
            f"{first.source}) against {_span(_companion_rows(50))} with outer sgd lr 1.0, "
            "what a top-k codec picks when no outer optimizer is given (its error feedback "
            "already acts as momentum)"
        ]
    at_10 = _companion_rows(10)
    return [
        f"upload codec {codec} at its companion settings (outer sgd, no momentum) still ended "
        f"{_span(_companion_rows(50))} above the best fp32 DiLoCo run at H = 50"
        + (f" ({_span(at_10)} at H = 10)" if at_10 else "")
        + f" in our runs ({first.upload_codec}; {first.setup}; {first.source}); with "
        "--aggregation sparse_mean (SparseLoCo's mean over each element's senders) the same "
        "runs ended "
        + " and ".join(f"{percent:+.1f} % at H = {h}" for h, percent in SPARSE_MEAN_COSTS)
    ]


def _default_warnings(codec: Codec) -> list[str]:
    """Top-k at its companion settings under sparse_mean: the measured costs of its chunk size
    (none measured: nothing to say), one sentence when one is over WARN_ABOVE_PERCENT."""
    rows = [row for row in DEFAULT_COSTS if row.topk_chunk == codec.chunk]
    over = [row for row in rows if row.percent > WARN_ABOVE_PERCENT]
    if not over:
        return []

    def said(row: DefaultCost) -> str:
        return (
            f"{row.percent:+.1f} % at {row.parameters} parameters (H = {row.sync_every}, "
            f"{row.outer_steps} outer steps)"
        )

    others = ", ".join(said(row) for row in rows if row not in over)
    return [
        f"upload codec {codec} at its companion settings (outer sgd lr 1, sparse_mean, chunks "
        f"of {codec.chunk}) ended " + " and ".join(said(row) for row in over) + " above fp32 "
        "DiLoCo at its defaults (outer nesterov lr 0.7) in our runs of topk:0.03+int2"
        + (f"; larger models did better: {others}" if others else "")
        + f" ({TOPK_RESULTS}, {DEFAULTS_RESULTS})"
    ]


def aggregation_conflict(upload_codec: Codec | str, aggregation: str) -> str | None:
    """Why `aggregation` contradicts the upload codec, or None. sparse_mean counts an element
    as sent where its value is not 0: right for top-k (a value left out is 0) and the same as
    the mean for fp32 and bf16 (whose zeros are exact, so nothing is lost), but an int8 or int4
    upload codes every small value as its zero level, and those would count as not sent, so
    the mean of the rest is biased away from 0. (int2 has no zero level.)"""
    codec = _codec(upload_codec)
    if aggregation != "sparse_mean" or codec.values not in ("int8", "int4"):
        return None
    kept = "its kept values' smallest" if codec.is_sparse else "every small value"
    return (
        f"aggregation sparse_mean counts an element as sent where its value is not 0, and "
        f"upload codec {codec} codes {kept} as 0, so those would count as not sent and bias "
        "the mean: use sparse_mean with top-k and int2, fp32 or bf16 values (its default "
        "there), or mean"
    )


# The decay of the workers' error-feedback accumulator e <- beta e + g where the codec keeps
# one (SparseLoCo, Sarfi et al. 2025, decays it too); 0 turns error feedback off.
DEFAULT_ERROR_FEEDBACK_BETA = 0.95
# Dense codecs whose rounding error feedback has not been measured to repay: bf16 and int8
# ended within 0.01 % with and without it (COMPRESSION_RESULTS; 237k parameters, 24 outer
# steps), int8 both ways 0.2 % lower without it at 137k parameters and 100 outer steps (one
# seed: INT8_FEEDBACK_RESULTS), while a worker
# that keeps a residual holds two more fp32 copies of the model (the residual and the next
# one, until the server has folded the body) and decodes every body it sends.
NO_FEEDBACK_VALUES = ("bf16", "int8")
INT8_FEEDBACK_RESULTS = "benchmarks/results/compression-int8-feedback/README.md"


def is_error_feedback_beta(value: object) -> bool:
    """Whether `value` is a beta error feedback can run with: a real number in [0, 1)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and 0 <= value < 1  # type: ignore[arg-type]


def error_feedback_default(upload_codec: Codec | str) -> float:
    """The error-feedback beta an upload codec runs with when none is given: 0 (off) for
    dense bf16 and int8, DEFAULT_ERROR_FEEDBACK_BETA for every other codec (top-k needs it:
    its accumulator is SparseLoCo's momentum; int4 and int2 round coarsely). fp32 sends every
    value exactly, so its beta has no effect."""
    codec = _codec(upload_codec)
    if not codec.is_sparse and codec.values in NO_FEEDBACK_VALUES:
        return 0.0
    return DEFAULT_ERROR_FEEDBACK_BETA


def error_feedback_note(upload_codec: Codec | str, beta: float) -> str | None:
    """A sentence when an error-feedback beta was given that cannot act: the identity codec
    (fp32) sends every value as it is, so no residual is ever left to feed back. bf16 does
    round, so its residual is real. A note, not a refusal: a sweep over codecs gives one beta
    to all of them."""
    codec = _codec(upload_codec)
    if codec.is_identity and beta > 0:
        return (
            f"error-feedback beta {beta:g} has no effect with upload codec {codec}: it sends "
            "every value as it is, so no residual is left to feed back"
        )
    return None


def _companion_rows(sync_every: int) -> list[MeasuredCost]:
    return [
        row
        for row in MEASURED_COSTS
        if row.sparse and row.outer_momentum == 0 and row.sync_every == sync_every
    ]


def _span(rows: list[MeasuredCost]) -> str:
    low, high = min(r.percent for r in rows), max(r.percent for r in rows)
    return f"+{low:.1f} %" if low == high else f"+{low:.1f} % to +{high:.1f} %"


def _codec(upload_codec: Codec | str) -> Codec:
    return upload_codec if isinstance(upload_codec, Codec) else parse_codec(upload_codec)
