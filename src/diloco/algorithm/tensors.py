"""What kind each model tensor is, and the fp32 master copies the outer step works on.

The outer step treats tensors by kind: trainable parameters get the outer optimizer, frozen
parameters and buffers are averaged. Classifying once, from the model, keeps that decision out of
the server, which only ever sees names and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

TensorDict = dict[str, torch.Tensor]


@dataclass(frozen=True, eq=False)
class SparsePiece:
    """A flat span of `length` fp32 elements given by its kept values: `values` at `positions`
    (int64, from the span's first element, each at most once), 0 everywhere else. A top-k
    span as decoded for a fold, which adds its kept values (k / chunk of the span) instead of
    the whole span and its zeros (see RunningMean.add_pieces). `numel()` as a tensor's, so a
    reader counts either kind of piece alike."""

    length: int
    positions: torch.Tensor
    values: torch.Tensor

    def numel(self) -> int:
        return self.length

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The span as a flat fp32 tensor (written into `out` when given): what `decode`
        gives for it."""
        if out is None:
            out = torch.empty(self.length, dtype=torch.float32, device=self.values.device)
        out.zero_()
        if self.length:
            out.index_put_((self.positions,), self.values)
        return out


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or Inf (always True for integer and bool tensors).

    Fast path: a sum is finite only if every element is (NaN and Inf propagate), and a sum is
    one vectorised pass with no temporary mask. A non-finite sum can also be a plain overflow,
    so only then is the element-wise check run.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def finite_bound(tensor: torch.Tensor) -> float | None:
    """An upper bound of every |element|, or None when an element is NaN or Inf.

    One vectorised pass, as cheap as `all_finite`'s sum: sqrt(sum of squares) bounds the
    largest magnitude, and the sum of squares is finite exactly when no element is NaN or
    Inf, unless the values are huge (over ~1e19 in fp32). Then the element-wise check decides
    and the bound is the exact largest magnitude (a second pass, for such values only). The
    bound is doubled to cover the sum's rounding.
    """
    if tensor.numel() == 0:
        return 0.0
    if tensor.dtype == torch.bool:
        return 1.0
    if not tensor.is_floating_point():
        low, high = torch.aminmax(tensor.reshape(-1))
        return float(max(abs(int(low)), abs(int(high))))
    flat = tensor.reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    squares = float(torch.dot(flat, flat))
    if math.isfinite(squares):
        return 2.0 * math.sqrt(squares)
    if not bool(torch.isfinite(tensor).all()):
        return None
    return float(flat.abs().max())  # huge but finite values: their exact largest magnitude


class TensorKind(str, Enum):
    """How the outer step updates one state_dict entry."""

    TRAINABLE = "trainable"
    FROZEN = "frozen"
    FLOAT_BUFFER = "float_buffer"
    INT_BUFFER = "int_buffer"
    BOOL_BUFFER = "bool_buffer"


def _kind_of(name: str, tensor: torch.Tensor) -> TensorKind:
    if tensor.dtype == torch.bool:
        return TensorKind.BOOL_BUFFER
    if tensor.is_complex():
        raise ValueError(f"tensor {name!r} is complex ({tensor.dtype}); not supported")
    if not tensor.is_floating_point():
        return TensorKind.INT_BUFFER
    if isinstance(tensor, torch.nn.Parameter):
        return TensorKind.TRAINABLE if tensor.requires_grad else TensorKind.FROZEN
    return TensorKind.FLOAT_BUFFER


def classify_tensors(model: torch.nn.Module) -> dict[str, TensorKind]:
    """Kind of every tensor in `model.state_dict()` (parameters and persistent buffers).

    A non-float parameter counts as an int or bool buffer by its dtype; it has no gradient to
    give to an optimizer. Non-tensor entries (a module's extra state) are left out.
    """
    state = model.state_dict(keep_vars=True)
    return {
        name: _kind_of(name, value)
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def to_fp32_masters(
    state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"
) -> TensorDict:
    """Detached, contiguous copies on `device` (the CPU by default) to serve as master weights.

    Floating tensors become float32 whatever their training dtype, so repeated outer steps do
    not accumulate bf16/fp16 rounding. Integer and bool tensors keep their own dtype: they are
    averaged and rounded, never optimised. Non-tensor entries are left out.
    """
    masters: TensorDict = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        copy = torch.empty(value.shape, dtype=dtype, device=device)
        copy.copy_(value.detach())
        masters[name] = copy
    return masters
