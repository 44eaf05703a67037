"""A hostile (or broken) simulated worker: what it sends instead of its pseudo-gradient.

The robust-aggregation benchmark's three attacks, applied to the trainable floating tensors
of the last worker's pseudo-gradient g (buffers go as they are):
  - `scale100`: 100 g, a worker whose update is blown up (a bug, or an attack on the mean);
  - `sign_flip`: -g, a worker pushing the model back the way it came;
  - `noise`: Gaussian noise of the same L2 norm as g, a worker that sends garbage that no
    norm check can tell apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from diloco.algorithm import TensorKind
from diloco.algorithm.robust import trained, update_norm

HOSTILE = ("none", "scale100", "sign_flip", "noise")


def check_hostile(kind: str) -> str:
    if kind not in HOSTILE:
        raise ValueError(f"hostile must be one of {', '.join(HOSTILE)}, got {kind!r}")
    return kind


def corrupt(
    gradient: Mapping[str, torch.Tensor],
    kind: str,
    kinds: Mapping[str, TensorKind],
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """What a worker of `kind` sends instead of `gradient`."""
    check_hostile(kind)
    moved = [name for name, tensor in gradient.items() if trained(kinds, name, tensor)]
    out = dict(gradient)
    if kind == "scale100":
        out.update({n: gradient[n] * 100 for n in moved})
    elif kind == "sign_flip":
        out.update({n: -gradient[n] for n in moved})
    elif kind == "noise":
        noise = {n: torch.randn(gradient[n].shape, generator=generator) for n in moved}
        scale = update_norm(gradient, kinds) / max(update_norm(noise, kinds), math.ulp(1.0))
        out.update({n: noise[n] * scale for n in moved})
    return out
