"""Tagged JSON: optimizer, scheduler and RNG state through JSON, exactly and without pickle.

Tuples, non-finite floats, non-string keys and tensor references survive the round trip, so
that loading a state dict into a fresh optimizer continues training bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def encode(value: Any, path: str, tensors: dict[str, torch.Tensor] | None, what: str) -> Any:
    """`value` as JSON that decode turns back into an equal value of the same types.

    Tensors go to `tensors` under their dotted path (e.g. `state.0.exp_avg`) and are replaced
    by a reference; with `tensors` None a tensor, like any other non-JSON value, is a
    ValueError naming its key. Tuples, non-finite floats and dicts whose keys are not plain
    strings are tagged objects, so that nothing changes type on the way back.
    """
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise ValueError(f"{what} key {path!r} holds a tensor, which is not JSON-able")
        if path in tensors:  # e.g. the keys 0 and "0" of one dict
            raise ValueError(f"{what} has two tensors under the key {path!r}")
        tensors[path] = value.detach()
        return {"$tensor": path}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, (list, tuple)):
        items = [encode(item, _join(path, i), tensors, what) for i, item in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {
                key: encode(item, _join(path, key), tensors, what) for key, item in value.items()
            }
        return {
            "$dict": [
                [
                    encode(key, _join(path, key), None, what),
                    encode(item, _join(path, key), tensors, what),
                ]
                for key, item in value.items()
            ]
        }
    raise ValueError(f"{what} key {path!r} holds a {type(value).__name__}, which is not JSON-able")


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of encode, taking referenced tensors from `tensors`."""
    if isinstance(value, list):
        return [decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tensor":
            return tensors[inner]
        if tag == "$tuple":
            return tuple(decode(item, tensors) for item in inner)
        if tag == "$float":
            return float(inner)
        if tag == "$dict":
            return {decode(key, tensors): decode(item, tensors) for key, item in inner}
    return {key: decode(item, tensors) for key, item in value.items()}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def check_plain_json(value: Any, what: str, path: str = "") -> None:
    """Leases are opaque JSON: plain values, lists and string-keyed dicts only."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float) and math.isfinite(value):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain_json(item, what, _join(path, index))
        return
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        for key, item in value.items():
            check_plain_json(item, what, _join(path, key))
        return
    raise ValueError(f"{what} key {path!r} holds a {type(value).__name__}, which is not JSON")
