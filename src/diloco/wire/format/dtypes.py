"""Dtype names of the protocol, their torch dtypes and their safetensors codes.

The protocol names dtypes in words (`float32`, `bfloat16`, ...) while safetensors headers use
codes (`F32`, `BF16`, ...); keeping both tables here means no other module spells either.
"""

from __future__ import annotations

import torch

# (protocol name, torch dtype, safetensors code), in the order docs/protocol.md lists them.
_TABLE: tuple[tuple[str, torch.dtype, str], ...] = (
    ("float32", torch.float32, "F32"),
    ("bfloat16", torch.bfloat16, "BF16"),
    ("float16", torch.float16, "F16"),
    ("float64", torch.float64, "F64"),
    ("int64", torch.int64, "I64"),
    ("int32", torch.int32, "I32"),
    ("int16", torch.int16, "I16"),
    ("int8", torch.int8, "I8"),
    ("uint8", torch.uint8, "U8"),
    ("bool", torch.bool, "BOOL"),
)

DTYPE_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _TABLE)
SAFETENSORS_CODES: tuple[str, ...] = tuple(code for _, _, code in _TABLE)

_BY_NAME = {name: dtype for name, dtype, _ in _TABLE}
_NAME_OF = {dtype: name for name, dtype, _ in _TABLE}
_BY_CODE = {code: dtype for _, dtype, code in _TABLE}
_CODE_OF = {dtype: code for _, dtype, code in _TABLE}

# Float dtypes a server may choose for tensors on the wire (--upload-dtype / --download-dtype).
WIRE_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
WIRE_FLOAT_DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")

_WIRE_ALIASES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name of `dtype`, e.g. `torch.bfloat16` -> "bfloat16"."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported on the wire; supported: {', '.join(DTYPE_NAMES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a protocol dtype name, e.g. "int64" -> `torch.int64`."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPE_NAMES)}") from None


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors header code of `dtype`, e.g. `torch.float32` -> "F32"."""
    try:
        return _CODE_OF[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported on the wire; supported: {', '.join(DTYPE_NAMES)}"
        ) from None


def dtype_from_safetensors_code(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors code, or None for a code the protocol does not allow."""
    return _BY_CODE.get(code)


def parse_wire_dtype(text: str) -> torch.dtype:
    """Parse a --upload-dtype / --download-dtype value: fp32, float32, bf16 or bfloat16."""
    key = text.strip().lower() if isinstance(text, str) else text
    try:
        return _WIRE_ALIASES[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"wire dtype must be one of fp32, float32, bf16, bfloat16; got {text!r}"
        ) from None
