"""How much a stale asynchronous pseudo-gradient counts.

Staleness is the number of outer steps applied between the worker's anchor and the arrival of
its pseudo-gradient. `inverse_sqrt` scales the values (not the weight) by (1 + staleness)^-1/2,
so an old update moves the model less; `none` applies it as it is.
"""

from __future__ import annotations

import math

from diloco.algorithm._checks import require_choice

STALENESS_WEIGHTINGS = ("none", "inverse_sqrt")


def staleness_scale(staleness: int, weighting: str) -> float:
    """The factor a pseudo-gradient `staleness` outer steps old is multiplied by."""
    require_choice("staleness weighting", weighting, STALENESS_WEIGHTINGS)
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if weighting == "inverse_sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    return 1.0
