"""Delayed Nesterov, the async outer optimizer of Liu et al. 2024 (Algorithm 3).

In async DiLoCo each worker's pseudo-gradient is applied the moment it arrives. Updating the
momentum on every arrival lets stale, single-worker gradients dominate it; Delayed Nesterov
applies each arrival as a plain (1/N-scaled) step and folds the buffered arrivals into the
momentum only every N arrivals. With c > 0 part of the momentum is also applied in between.

Per name, with arrival count t (1-based), momentum m (starts at 0) and buffer D:
    D += g
    t % N != 0:  theta -= lr * (c * beta * m + g / N)
    t % N == 0:  m = beta * m + D / N;  theta -= lr * ((1 - c (N - 1)) * beta * m + g / N);  D = 0
Over one cycle of N arrivals the momentum applied adds up to one beta * m step, whatever c:
N - 1 arrivals apply c each and the N-th the rest, 1 - c (N - 1) (Algorithm 3 of the paper).
So c is in [0, 1 / (N - 1)] (any c in [0, 1] when N = 1, where it has no effect). N = 1 is
torch.optim.SGD(nesterov=True).

state_dict keys: "__arrivals__" (0-dim int64, the number of step() calls), and per tensor name
"momentum/<name>", "accumulated/<name>" (D) and "arrivals/<name>" (0-dim int64, t). Counts are
kept per name so that arrivals carrying only some names (one fragment) still cycle correctly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.algorithm._checks import require_fraction, require_int_at_least, require_positive
from diloco.algorithm.outer_optimizer import check_step_inputs
from diloco.algorithm.tensors import TensorDict

ARRIVALS_KEY = "__arrivals__"
MOMENTUM_PREFIX = "momentum/"
ACCUMULATED_PREFIX = "accumulated/"
NAME_ARRIVALS_PREFIX = "arrivals/"


@dataclass
class _NameState:
    momentum: torch.Tensor
    accumulated: torch.Tensor
    arrivals: int = 0

    def matches(self, param: torch.Tensor) -> bool:
        return self.momentum.shape == param.shape and self.momentum.dtype == param.dtype


class DelayedNesterov:
    """Outer optimizer for async rounds: one `step` per arriving pseudo-gradient.

    `delay` is N, the arrivals per momentum update (often the number of workers); `c` is the
    fraction of momentum applied between momentum updates.
    """

    def __init__(
        self, lr: float = 0.7, momentum: float = 0.9, delay: int = 1, c: float = 0.0
    ) -> None:
        self.lr = require_positive("delayed nesterov lr", lr)
        self.momentum = require_fraction("delayed nesterov momentum", momentum, include_one=False)
        self.delay = require_int_at_least("delayed nesterov delay", delay, 1)
        self.c = require_fraction("delayed nesterov c", c, include_one=True)
        if self.delay > 1 and self.c * (self.delay - 1) > 1:
            raise ValueError(
                f"delayed nesterov c must be in [0, 1/(N - 1)] = [0, {1 / (self.delay - 1):g}] "
                f"for delay N = {self.delay}, so that a cycle applies one momentum step; "
                f"got {c!r}"
            )
        self.arrivals = 0
        self._states: dict[str, _NameState] = {}

    def describe(self) -> dict[str, str | float | int]:
        """The settings, for reports such as the server's /v1/info."""
        return {
            "kind": "delayed_nesterov",
            "lr": self.lr,
            "momentum": self.momentum,
            "delay": self.delay,
            "c": self.c,
        }

    def step(
        self,
        params: TensorDict,
        grad: Mapping[str, torch.Tensor],
        *,
        divisors: Mapping[str, float] | None = None,
        finite: bool = False,
    ) -> None:
        """Apply one arrival's pseudo-gradient to `params` in place (only the names it carries).

        `divisors` and `finite` as for `OuterOptimizer.step`: grad[name] is a running sum, to
        be divided (in place) by divisors[name]; `finite` says the caller proved it finite.
        """
        check_step_inputs(params, grad, "delayed nesterov step", scan_values=not finite)
        self.arrivals += 1
        for name, g in grad.items():
            if divisors is not None and divisors[name] != 1.0:
                g = g.div_(divisors[name])
            self._step_one(name, params[name], g)

    def _state_for(self, name: str, param: torch.Tensor) -> _NameState:
        state = self._states.get(name)
        if state is None or not state.matches(param):
            state = _NameState(torch.zeros_like(param), torch.zeros_like(param))
            self._states[name] = state
        return state

    def _step_one(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._state_for(name, param)
        g = grad.detach().to(device=param.device, dtype=param.dtype)
        state.accumulated.add_(g)
        state.arrivals += 1
        update = g.div(self.delay)
        if state.arrivals % self.delay != 0:
            update.add_(state.momentum, alpha=self.c * self.momentum)
        else:
            state.momentum.mul_(self.momentum).add_(state.accumulated.div(self.delay))
            applied_rest = 1 - self.c * (self.delay - 1)  # the cycle's c terms add up to 1
            update.add_(state.momentum, alpha=applied_rest * self.momentum)
            state.accumulated.zero_()
        param.add_(update, alpha=-self.lr)

    def state_dict(self, copy: bool = True) -> TensorDict:
        """Momentum, accumulated buffer and arrival count per name, plus the total arrivals.

        `copy=False` returns the live buffers, for a caller that serialises them at once.
        """
        out: TensorDict = {ARRIVALS_KEY: torch.tensor(self.arrivals, dtype=torch.int64)}
        for name, state in self._states.items():
            out[MOMENTUM_PREFIX + name] = state.momentum.clone() if copy else state.momentum
            out[ACCUMULATED_PREFIX + name] = (
                state.accumulated.clone() if copy else state.accumulated
            )
            out[NAME_ARRIVALS_PREFIX + name] = torch.tensor(state.arrivals, dtype=torch.int64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all state with `state` (as returned by `state_dict`)."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key == ARRIVALS_KEY:
                continue
            for prefix in (MOMENTUM_PREFIX, ACCUMULATED_PREFIX, NAME_ARRIVALS_PREFIX):
                if key.startswith(prefix):
                    parts.setdefault(key[len(prefix) :], {})[prefix] = value
                    break
            else:
                raise ValueError(f"delayed nesterov state: unexpected key {key!r}")
        states: dict[str, _NameState] = {}
        for name, found in parts.items():
            missing = [p for p in (MOMENTUM_PREFIX, ACCUMULATED_PREFIX) if p not in found]
            if missing:
                raise ValueError(f"delayed nesterov state: {name!r} lacks {missing}")
            momentum = found[MOMENTUM_PREFIX].detach().to("cpu").clone()
            accumulated = found[ACCUMULATED_PREFIX].detach().to("cpu").clone()
            if momentum.shape != accumulated.shape:
                raise ValueError(f"delayed nesterov state: {name!r} has mismatched buffers")
            count = found.get(NAME_ARRIVALS_PREFIX)
            states[name] = _NameState(momentum, accumulated, int(count) if count is not None else 0)
        arrivals = state.get(ARRIVALS_KEY)
        self.arrivals = int(arrivals) if arrivals is not None else 0
        self._states = states

    def reset(self, name: str | None = None) -> None:
        """Forget the state of `name` (of every name, and the arrival count, when None)."""
        if name is None:
            self._states.clear()
            self.arrivals = 0
        else:
            self._states.pop(name, None)
