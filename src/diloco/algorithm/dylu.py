"""DyLU, dynamic local updates (Liu et al. 2024): slower workers get fewer local steps.

In async DiLoCo every worker should finish its local steps in about the same wall time, so a
worker at speed v_w runs H_w = max(1, floor(v_w / max(v) * H)) steps and nobody idles.

Speeds are reported by the workers themselves, so one absurd report (1e6 steps/s) would give
everyone else H_w = 1. With `max_ratio` R the reference speed is min(max(v), R * min(v)): no
worker is ever given fewer than about H / R steps, whatever another one claims (the server
and the simulator both use R = MAX_SPEED_RATIO = 16; honest speeds within a factor R of each
other are unaffected).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import overload

from diloco.algorithm._checks import require_int_at_least

# The reference speed is at most this many times the slowest one (server and simulator).
MAX_SPEED_RATIO = 16.0

# v / max(v) * H can land a hair below an integer (0.29 * 100 = 28.999999999999996).
_FLOOR_SLACK = 1e-9


def _check_speed(label: str, speed: float) -> float:
    ok = isinstance(speed, numbers.Real) and not isinstance(speed, bool)
    if not ok or not math.isfinite(speed) or speed <= 0:
        raise ValueError(f"speed of {label} must be finite and > 0, got {speed!r}")
    return float(speed)


def _steps(speed: float, fastest: float, sync_every: int) -> int:
    return max(1, math.floor(speed / fastest * sync_every + _FLOOR_SLACK))


def _reference(values: Sequence[float], max_ratio: float | None) -> float:
    """max(v), or at most `max_ratio` times the slowest speed."""
    fastest = max(values)
    return fastest if max_ratio is None else min(fastest, max_ratio * min(values))


@overload
def dylu_local_steps(
    speeds: Mapping[str, float], sync_every: int, max_ratio: float | None = None
) -> dict[str, int]: ...


@overload
def dylu_local_steps(
    speeds: Sequence[float], sync_every: int, max_ratio: float | None = None
) -> list[int]: ...


def dylu_local_steps(
    speeds: Mapping[str, float] | Sequence[float],
    sync_every: int,
    max_ratio: float | None = None,
) -> dict[str, int] | list[int]:
    """Local steps per worker, keyed like `speeds` (a dict by worker, or a list by index).

    Speeds are any consistent rate (steps/s, tokens/s); only their ratios matter. A worker
    faster than the reference (see the module; `max_ratio` >= 1) gets H.
    """
    require_int_at_least("sync_every H", sync_every, 1)
    if max_ratio is not None and not (math.isfinite(max_ratio) and max_ratio >= 1):
        raise ValueError(f"max_ratio must be finite and >= 1, got {max_ratio!r}")
    if isinstance(speeds, Mapping):
        checked = {worker: _check_speed(f"worker {worker!r}", v) for worker, v in speeds.items()}
        if not checked:
            return {}
        reference = _reference(list(checked.values()), max_ratio)
        return {
            worker: min(sync_every, _steps(v, reference, sync_every))
            for worker, v in checked.items()
        }
    values = [_check_speed(f"worker index {index}", v) for index, v in enumerate(speeds)]
    if not values:
        return []
    reference = _reference(values, max_ratio)
    return [min(sync_every, _steps(v, reference, sync_every)) for v in values]
