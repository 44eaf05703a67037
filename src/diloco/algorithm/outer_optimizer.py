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
# Elements a kept grad is divided and stepped in at a time (4 MiB of fp32). A multiple of 64,
# so every piece starts on a vector boundary of the kernel's SIMD loop: its scalar tail (which
# rounds differently, without fused multiply-adds) then holds the same elements as in one call.
KEPT_PIECE = 1 << 20


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
        keep_grads: bool = False,
    ) -> None:
        """Update `params` in place for the names in `grads`; other names are untouched.

        `divisors`: the gradient of a name is grads[name] / divisors[name] (a running sum and
        its total weight); the division is done in place, on the grads, inside the step's one
        pass. `finite=True`: the caller has proven every grad finite, so they are not scanned.
        `keep_grads=True`: the grads are never written (each is divided piece by piece into a
        scratch buffer and stepped from there: the same values, element for element), so
        another thread may read them meanwhile (the server writes its step log from them).
        """
        check_step_inputs(params, grads, "outer step", scan_values=not finite)
        for name, grad in grads.items():
            divisor = 1.0 if divisors is None else divisors[name]
            if keep_grads and divisor != 1.0:
                self._step_kept(name, params[name], grad, divisor)
            else:
                self._step_one(name, params[name], grad, divisor)

    def _step_kept(
        self, name: str, param: torch.Tensor, grad: torch.Tensor, divisor: float
    ) -> None:
        """`_step_one` of grad / divisor without writing `grad`: piece by piece through a
        scratch buffer when the fused kernel can update param and buffer in place (every
        term of the update is element-wise); else the whole quotient at once."""
        g = grad.detach()
        buf = self._buffers.get(name)
        in_place = (
            param.is_contiguous()
            and g.is_contiguous()
            and g.dtype == param.dtype
            and g.device == param.device
            and (self.kind == "sgd" or buf is not None)
            and (
                buf is None
                or (
                    buf.shape == param.shape
                    and buf.dtype == param.dtype
                    and buf.device == param.device
                    and buf.is_contiguous()
                )
            )
        )
        if not in_place:  # (a name's first momentum step, or a grad on another device)
            quotient = torch.div(g.to(device=param.device, dtype=param.dtype), divisor)
            self._step_one(name, param, quotient)
            return
        flat_param, flat_grad = param.view(-1), g.view(-1)
        flat_buf = None if buf is None else buf.view(-1)
        total = flat_param.numel()
        scratch = torch.empty(min(total, KEPT_PIECE), dtype=param.dtype, device=param.device)
        for start in range(0, total, KEPT_PIECE):
            stop = min(total, start + KEPT_PIECE)
            piece = torch.div(flat_grad[start:stop], divisor, out=scratch[: stop - start])
            self._fused_step(
                flat_param[start:stop],
                piece,
                [None if flat_buf is None else flat_buf[start:stop]],
            )

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
