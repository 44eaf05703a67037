"""The outer optimizer: SGD, momentum SGD or Nesterov on the fp32 master weights.

Semantics are exactly torch.optim.SGD with dampening 0 and no weight decay, so results can be
checked against PyTorch and compared with the DiLoCo papers. Momentum buffers are keyed by
tensor name: a round that carries only some names (one streaming fragment) leaves every other
name's weights and momentum alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.optim.sgd import sgd as torch_sgd

from diloco.algorithm._checks import (
    require_choice,
    require_fraction,
    require_positive,
)
from diloco.algorithm.tensors import TensorDict, all_finite

OUTER_KINDS = ("sgd", "momentum", "nesterov")
DEFAULT_MOMENTUM = 0.9


def check_step_inputs(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    who: str,
    scan_values: bool = True,
) -> None:
    """Raise ValueError, naming the tensor, if any grad cannot be applied to `params`.

    Called before the first in-place write, so a bad input leaves every weight as it was.
    `scan_values=False` skips the NaN/Inf scan, for grads the caller has proven finite.
    """
    for name, grad in grads.items():
        param = params.get(name)
        if param is None:
            raise ValueError(f"{who}: tensor {name!r} is not in the parameters")
        if not param.is_floating_point():
            raise ValueError(f"{who}: tensor {name!r} has dtype {param.dtype}, not floating")
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(
                f"{who}: tensor {name!r} has shape {tuple(grad.shape)}, "
                f"parameter has {tuple(param.shape)}"
            )
        if scan_values and not all_finite(grad):
            raise ValueError(f"{who}: tensor {name!r} has NaN or Inf values")


class OuterOptimizer:
    """SGD ("sgd"), heavy-ball ("momentum") or Nesterov ("nesterov") over name->tensor dicts.

    `momentum` defaults to 0.9 for "momentum"/"nesterov" and to 0 for "sgd"; an explicit
    non-zero momentum with "sgd" is an error rather than being silently ignored.
    """

    def __init__(
        self, kind: str = "nesterov", lr: float = 0.7, momentum: float | None = None
    ) -> None:
        self.kind = require_choice("outer optimizer kind", kind, OUTER_KINDS)
        self.lr = require_positive("outer lr", lr)
        if kind == "sgd":
            if momentum not in (None, 0):
                raise ValueError(f"outer momentum must be 0 for kind 'sgd', got {momentum!r}")
            self.momentum = 0.0
        else:
            chosen = DEFAULT_MOMENTUM if momentum is None else momentum
            self.momentum = require_fraction("outer momentum", chosen, include_one=False)
        self._buffers: TensorDict = {}

    def describe(self) -> dict[str, str | float]:
        """The settings, for reports such as the server's /v1/info."""
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum}

    def step(
        self,
        params: TensorDict,
        grads: Mapping[str, torch.Tensor],
        *,
        divisors: Mapping[str, float] | None = None,
        finite: bool = False,
    ) -> None:
        """Update `params` in place for the names in `grads`; other names are untouched.

        `divisors`: the gradient of a name is grads[name] / divisors[name] (a running sum and
        its total weight); the division is done in place, on the grads, inside the step's one
        pass. `finite=True`: the caller has proven every grad finite, so they are not scanned.
        """
        check_step_inputs(params, grads, "outer step", scan_values=not finite)
        for name, grad in grads.items():
            divisor = 1.0 if divisors is None else divisors[name]
            self._step_one(name, params[name], grad, divisor)

    def _step_one(
        self, name: str, param: torch.Tensor, grad: torch.Tensor, divisor: float = 1.0
    ) -> None:
        g = grad.detach().to(device=param.device, dtype=param.dtype)  # grad itself if it can
        buf = self._buffers.get(name)
        if buf is not None and (buf.shape != param.shape or buf.dtype != param.dtype):
            buf = None  # restarts as buf = g
        if buf is not None:
            buf = buf.to(param.device)
        # PyTorch's fused kernel reads and writes the memory as if it were contiguous.
        fusable = param.is_contiguous() and g.is_contiguous()
        if fusable and (buf is None or buf.is_contiguous()):
            buffers = [buf]
            self._fused_step(param, g, buffers, divisor)
        else:
            if divisor != 1.0:
                g.div_(divisor)  # in place: on grad itself when no copy was needed, as documented
            buffers = [self._unfused_step(param, g, buf)]
        if self.kind != "sgd":
            self._buffers[name] = buffers[0]

    def _fused_step(
        self,
        param: torch.Tensor,
        g: torch.Tensor,
        buffers: list[torch.Tensor | None],
        divisor: float = 1.0,
    ) -> None:
        """PyTorch's fused kernel: one pass over param, grad and buffer (buf = mu buf + g, a
        new buffer = g when it is None; p -= lr (g + mu buf) for nesterov, lr buf for
        momentum, lr g for sgd). About 1.6x a plain in-place pass, against 2.8x in three."""
        before = buffers[0]
        scale = None if divisor == 1.0 else torch.tensor(divisor, dtype=torch.float32)
        try:
            torch_sgd(
                [param],
                [g],
                buffers,
                fused=True,
                grad_scale=scale,  # the kernel divides g by it, in place
                weight_decay=0.0,
                momentum=self.momentum,
                lr=self.lr,
                dampening=0.0,
                nesterov=self.kind == "nesterov",
                maximize=False,
            )
        except RuntimeError:  # no fused kernel for this device or dtype (checked before writing)
            if divisor != 1.0:
                g.div_(divisor)
            buffers[0] = self._unfused_step(param, g, before)

    def _unfused_step(
        self, param: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The same update in separate passes, where PyTorch has no fused kernel."""
        if self.kind == "sgd":
            param.add_(g, alpha=-self.lr)
            return None
        if buf is None:
            buf = g.clone()
        else:
            torch.add(g, buf, alpha=self.momentum, out=buf)  # buf = mu buf + g, one pass
        if self.kind == "nesterov":
            param.add_(g, alpha=-self.lr).add_(buf, alpha=-self.lr * self.momentum)
        else:
            param.add_(buf, alpha=-self.lr)
        return buf

    def state_dict(self, copy: bool = True) -> TensorDict:
        """Momentum buffer per name; empty for "sgd".

        Copies by default; `copy=False` returns the live buffers, for a caller that only
        serialises them at once (a checkpoint) and must not double the memory.
        """
        if not copy:
            return dict(self._buffers)
        return {name: buf.clone() for name, buf in self._buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all momentum buffers; "sgd" has none and ignores them."""
        if self.kind == "sgd":
            self._buffers = {}
            return
        self._buffers = {name: buf.detach().to("cpu").clone() for name, buf in state.items()}

    def reset(self, name: str | None = None) -> None:
        """Drop the momentum of `name` (of every name when None); it restarts as buf = g."""
        if name is None:
            self._buffers.clear()
        else:
            self._buffers.pop(name, None)
