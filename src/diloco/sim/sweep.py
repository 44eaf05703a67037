"""A grid of settings for `diloco simulate --sweep KEY=V1,V2,...`, checked before any training.

Keys are the command's own option names (`outer-lr` or `outer_lr`); each value takes the type
of the option's current value, so `--sweep sync-every=10,50` gives integers and
`--sweep upload-codec=int8,int4` strings. Several `--sweep` options make their product.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

MAX_RUNS = 256
# A list-valued option, and the data set (every run of a sweep trains on the same corpus)
NOT_SWEPT = frozenset({"speeds", "corpus"})
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


# Options whose default is None, by the type their values take (any other such option: text)
UNSET_KINDS: dict[str, type] = {
    "outer_momentum": float,
    "outer_lr": float,
    "error_feedback_beta": float,
}


def _value(key: str, text: str, current: object) -> object:
    """One swept value in the type of the option's current value (UNSET_KINDS for None)."""
    text = text.strip()
    if current is None and UNSET_KINDS.get(key.replace("-", "_")) is not float:
        return text
    try:
        if isinstance(current, bool):
            lowered = text.lower()
            if lowered not in _TRUE | _FALSE:
                raise ValueError
            return lowered in _TRUE
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float) or current is None:
            return float(text)
    except ValueError:
        kind = {bool: "true or false", int: "an integer"}.get(type(current), "a number")
        raise ValueError(f"--sweep {key}: {text!r} is not {kind}") from None
    return text


def parse_sweeps(specs: Sequence[str], options: Mapping[str, object]) -> list[dict[str, object]]:
    """Every combination of the swept values, as option overrides, in the order given.

    Raises ValueError naming the spec for an unknown key, a key swept twice, a value that
    does not parse, a repeated value, or a grid of more than MAX_RUNS runs.
    """
    axes: list[tuple[str, list[object]]] = []
    for spec in specs:
        key_text, sep, values_text = spec.partition("=")
        key = key_text.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--sweep must look like KEY=V1,V2,..., got {spec!r}")
        if key not in options or key in NOT_SWEPT:
            allowed = ", ".join(k.replace("_", "-") for k in options if k not in NOT_SWEPT)
            raise ValueError(f"--sweep {key_text.strip()!r} is not a setting; sweepable: {allowed}")
        if any(key == seen for seen, _ in axes):
            raise ValueError(f"--sweep {key_text.strip()} is given twice; list its values once")
        parts = [part for part in values_text.split(",") if part.strip()]
        if not parts:
            raise ValueError(f"--sweep {key_text.strip()} has no values")
        values = [_value(key_text.strip(), part, options[key]) for part in parts]
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"--sweep {key_text.strip()} lists {', '.join(repeated)} twice")
        axes.append((key, values))
    runs = 1
    for _, values in axes:
        runs *= len(values)
    if runs > MAX_RUNS:
        raise ValueError(f"--sweep makes {runs} runs; at most {MAX_RUNS} in one command")
    keys = [key for key, _ in axes]
    combos = itertools.product(*(values for _, values in axes))
    return [dict(zip(keys, combo, strict=True)) for combo in combos]


def best_index(losses: Sequence[float]) -> int:
    """The run with the lowest final eval loss (the first one on a tie); NaN never wins."""
    ranked = [(loss, i) for i, loss in enumerate(losses) if loss == loss]
    return min(ranked)[1] if ranked else 0
