"""Checks that a decoded tensor body is what the model expects, before anything uses it.

A submission is folded into the round's running mean only after it passes, so one bad worker
(wrong architecture, a diverged run with NaNs) is refused with a sentence naming the tensor and
never corrupts the global model. The checks only read: nothing is cast or copied in place.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.algorithm.tensors import all_finite
from diloco.wire.errors import WireError
from diloco.wire.format.dtypes import dtype_name
from diloco.wire.format.specs import TensorSpec


def check_tensors(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, TensorSpec],
    *,
    float_dtype: torch.dtype | None,
    require_all: bool = True,
    scan_values: bool = True,
) -> None:
    """Raise WireError(422) unless `tensors` match `expected` by name, shape, dtype and finiteness.

    Floating tensors must have exactly `float_dtype` when it is given (the wire dtype), else any
    floating dtype (an initial upload, stored as fp32 masters). Int and bool tensors must have
    their spec's dtype, except that with `float_dtype` given (a pseudo-gradient) they may also
    come as int64 (`algorithm.pseudo_gradient` subtracts int and bool buffers exactly in int64)
    or as float32 (exact up to 2**24; older workers sent every tensor in fp32). Never in bf16:
    257 would arrive as 256.
    Names, shapes and dtypes are all checked before any value is scanned for NaN or Inf.
    """
    for name in tensors:
        if name not in expected:
            raise WireError(
                422, "unknown_tensor", f"tensor {name!r} is not in the model", tensor=name
            )
    if require_all:
        for name in expected:
            if name not in tensors:
                raise WireError(
                    422, "missing_tensor", f"tensor {name!r} is missing from the body", tensor=name
                )
    for name, tensor in tensors.items():
        spec = expected[name]
        _check_shape(name, tensor, spec)
        _check_dtype(name, tensor, spec, float_dtype)
    if scan_values:  # off for stand-ins without storage (a spooled body scans its file)
        for name, tensor in tensors.items():
            check_finite(name, tensor)


def _check_shape(name: str, tensor: torch.Tensor, spec: TensorSpec) -> None:
    got = list(tensor.shape)
    if got != list(spec.shape):
        raise WireError(
            422,
            "wrong_shape",
            f"tensor {name!r} has shape {got}, the model expects {list(spec.shape)}",
            tensor=name,
            expected=list(spec.shape),
            got=got,
        )


def _check_dtype(
    name: str, tensor: torch.Tensor, spec: TensorSpec, float_dtype: torch.dtype | None
) -> None:
    got = tensor.dtype
    if spec.dtype.is_floating_point:
        ok = got == float_dtype if float_dtype is not None else got.is_floating_point
        wanted = _name(float_dtype) if float_dtype is not None else "a floating dtype"
    elif float_dtype is not None:
        allowed = dict.fromkeys((spec.dtype, torch.int64, torch.float32))
        ok = got in allowed
        wanted = " or ".join(_name(dtype) for dtype in allowed)
    else:
        ok = got == spec.dtype
        wanted = _name(spec.dtype)
    if not ok:
        raise WireError(
            422,
            "wrong_dtype",
            f"tensor {name!r} has dtype {_name(got)}, expected {wanted}",
            tensor=name,
            expected=wanted,
            got=_name(got),
        )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """WireError(422) naming `name` and how many of its values are NaN or Inf."""
    if all_finite(tensor):
        return
    bad = int((~torch.isfinite(tensor.reshape(-1))).sum())
    raise WireError(
        422,
        "non_finite",
        f"tensor {name!r} holds {bad} NaN or Inf values of {tensor.numel()}",
        tensor=name,
        count=bad,
        numel=tensor.numel(),
    )


def _name(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")
