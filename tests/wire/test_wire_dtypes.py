"""Dtype names, torch dtypes and safetensors codes map one to one."""

import pytest
import torch

from diloco.wire import (
    DTYPE_NAMES,
    SAFETENSORS_CODES,
    WIRE_FLOAT_DTYPES,
    dtype_from_safetensors_code,
    dtype_name,
    parse_wire_dtype,
    safetensors_code,
    torch_dtype,
)


def test_every_protocol_name_round_trips_through_torch_and_safetensors() -> None:
    assert DTYPE_NAMES == (
        "float32",
        "bfloat16",
        "float16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    assert SAFETENSORS_CODES == (
        "F32",
        "BF16",
        "F16",
        "F64",
        "I64",
        "I32",
        "I16",
        "I8",
        "U8",
        "BOOL",
    )
    for name, code in zip(DTYPE_NAMES, SAFETENSORS_CODES, strict=True):
        dtype = torch_dtype(name)
        assert dtype_name(dtype) == name
        assert safetensors_code(dtype) == code
        assert dtype_from_safetensors_code(code) is dtype


def test_unknown_names_are_errors_that_list_the_allowed_names() -> None:
    with pytest.raises(ValueError, match="allowed: float32, bfloat16"):
        torch_dtype("float8")
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)
    assert dtype_from_safetensors_code("F8_E4M3") is None


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (" BF16 ", torch.bfloat16),
    ],
)
def test_parse_wire_dtype_accepts_the_two_wire_floats(text: str, dtype: torch.dtype) -> None:
    assert parse_wire_dtype(text) is dtype
    assert dtype in WIRE_FLOAT_DTYPES


@pytest.mark.parametrize("text", ["fp16", "float16", "int64", "", "float"])
def test_parse_wire_dtype_refuses_everything_else(text: str) -> None:
    with pytest.raises(ValueError, match="fp32, float32, bf16, bfloat16"):
        parse_wire_dtype(text)
