"""What a model's tensors are (name, shape, dtype, kind) and the fingerprint that identifies it.

Registration compares a worker's specs with the model's before any bytes move, so a worker with
the wrong architecture is told which tensor differs instead of failing on its first upload.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco.algorithm import TensorKind
from diloco.wire.errors import WireError
from diloco.wire.format.dtypes import dtype_name, torch_dtype

TENSOR_KINDS: tuple[str, ...] = tuple(kind.value for kind in TensorKind)

# Every floating dtype is written under this name in a fingerprint: the server's masters are
# fp32, so a bf16 worker and an fp32 worker of one architecture are the same model.
_FINGERPRINT_FLOAT = "float32"


@dataclass(frozen=True)
class TensorSpec:
    """One state_dict entry as the protocol describes it; `kind` is a TensorKind value."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str

    @property
    def trained(self) -> bool:
        """Trainable and floating: what the outer optimizer steps, codecs compress and robust
        aggregation measures (buffers, frozen and integer tensors are averaged)."""
        return self.kind == TensorKind.TRAINABLE.value and self.dtype.is_floating_point

    def to_json(self) -> dict[str, Any]:
        """`{"name", "shape", "dtype", "kind"}` with the protocol's dtype name."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "kind": self.kind,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        """Parse one JSON tensor entry; WireError(422, invalid_request) names the bad field."""
        if not isinstance(data, Mapping):
            raise _invalid("a tensor spec must be a JSON object", "tensors")
        extra = sorted(set(data) - {"name", "shape", "dtype", "kind"})
        if extra:
            raise _invalid(f"tensor spec has unknown field {extra[0]!r}", extra[0])
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid("tensor spec field 'name' must be a non-empty string", "name")
        shape = data.get("shape")
        if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
            raise _invalid(
                f"tensor {name!r} field 'shape' must be a list of integers >= 0, got {shape!r}",
                "shape",
            )
        try:
            dtype = torch_dtype(data.get("dtype"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise _invalid(f"tensor {name!r} field 'dtype': {exc}", "dtype") from None
        kind = data.get("kind")
        if kind not in TENSOR_KINDS:
            raise _invalid(
                f"tensor {name!r} field 'kind' must be one of {', '.join(TENSOR_KINDS)}, "
                f"got {kind!r}",
                "kind",
            )
        return cls(name=name, shape=tuple(shape), dtype=dtype, kind=str(kind))


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _invalid(error: str, field: str) -> WireError:
    return WireError(422, "invalid_request", error, field=field)


def specs_of(
    state: Mapping[str, torch.Tensor], kinds: Mapping[str, str | TensorKind]
) -> list[TensorSpec]:
    """Specs of every tensor in `state`, in its order; non-tensor entries are left out."""
    specs = []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if name not in kinds:
            raise ValueError(f"tensor {name!r} has no kind; classify it with classify_tensors")
        kind = kinds[name]
        specs.append(
            TensorSpec(
                name=name,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                kind=kind.value if isinstance(kind, TensorKind) else TensorKind(kind).value,
            )
        )
    return specs


def fingerprint(specs: Sequence[TensorSpec]) -> str:
    """SHA-256 hex of the name-sorted `[[name, shape, dtype], ...]`, floats written "float32"."""
    entries = [
        [
            spec.name,
            list(spec.shape),
            _FINGERPRINT_FLOAT if spec.dtype.is_floating_point else dtype_name(spec.dtype),
        ]
        for spec in sorted(specs, key=lambda spec: spec.name)
    ]
    text = json.dumps(entries, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def first_difference(
    expected: Sequence[TensorSpec], got: Sequence[TensorSpec], model: str = "the model"
) -> str | None:
    """A sentence naming the first tensor, in name order, where `got` differs from `model`
    (`expected`: "the model", or a name such as "the run's model").

    Differences are a missing or unexpected name, another shape, or another dtype class: floats
    of any width match each other, int and bool dtypes must match exactly. None when they match.
    """
    want = {spec.name: spec for spec in expected}
    have = {spec.name: spec for spec in got}
    for name in sorted(want.keys() | have.keys()):
        wanted, worker = want.get(name), have.get(name)
        if worker is None:
            assert wanted is not None
            return (
                f"tensor {name!r} is missing; {model} has it with shape "
                f"{list(wanted.shape)} and dtype {dtype_name(wanted.dtype)}"
            )
        if wanted is None:
            return f"tensor {name!r} is not in {model}"
        if worker.shape != wanted.shape:
            return (
                f"tensor {name!r} has shape {list(worker.shape)}, {model} has {list(wanted.shape)}"
            )
        if not same_dtype_class(wanted.dtype, worker.dtype):
            return (
                f"tensor {name!r} has dtype {dtype_name(worker.dtype)}, "
                f"{model} has {_dtype_class_name(wanted.dtype)}"
            )
    return None


def same_dtype_class(expected: torch.dtype, got: torch.dtype) -> bool:
    """Floats match floats of any width; int and bool dtypes match only themselves."""
    if expected.is_floating_point:
        return got.is_floating_point
    return got == expected


def _dtype_class_name(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return f"a floating dtype ({dtype_name(dtype)})"
    return dtype_name(dtype)
