"""Argument checks shared by the algorithm modules.

Every bad setting must fail early with a message that names the field and its allowed range, so
a typo in a server flag reads as a sentence rather than as a NaN three rounds later.
"""

from __future__ import annotations

import math
import numbers


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_positive(field: str, value: float) -> float:
    """Return `value` as a float; it must be finite and > 0."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return float(value)


def require_fraction(field: str, value: float, *, include_one: bool) -> float:
    """Return `value` as a float in [0, 1] (or [0, 1) when `include_one` is False)."""
    in_range = (
        _is_real(value)
        and math.isfinite(value)
        and value >= 0
        and (value <= 1 if include_one else value < 1)
    )
    if not in_range:
        bracket = "]" if include_one else ")"
        raise ValueError(f"{field} must be in [0, 1{bracket}, got {value!r}")
    return float(value)


def require_int_at_least(field: str, value: int, minimum: int) -> int:
    """Return `value`; it must be an integer (not a bool) >= `minimum`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def require_choice(field: str, value: str, allowed: tuple[str, ...]) -> str:
    """Return `value`; it must be one of `allowed`."""
    if value not in allowed:
        names = ", ".join(repr(name) for name in allowed)
        raise ValueError(f"{field} must be one of {names}, got {value!r}")
    return value
