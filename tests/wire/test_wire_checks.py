"""check_tensors: each rejection has its kind and names the tensor; nothing is mutated."""

import pytest
import torch

from diloco.wire import TensorSpec, WireError, check_tensors

SPECS = {
    "w": TensorSpec("w", (2, 3), torch.float32, "trainable"),
    "b": TensorSpec("b", (3,), torch.float32, "frozen"),
    "n": TensorSpec("n", (), torch.int64, "int_buffer"),
    "m": TensorSpec("m", (2,), torch.bool, "bool_buffer"),
}


def _body(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "w": torch.ones(2, 3, dtype=dtype),
        "b": torch.zeros(3, dtype=dtype),
        "n": torch.tensor(4),
        "m": torch.tensor([True, False]),
    }


def _rejected(tensors: dict, kind: str, tensor: str, **options: object) -> WireError:
    options.setdefault("float_dtype", torch.float32)
    with pytest.raises(WireError) as caught:
        check_tensors(tensors, SPECS, **options)  # type: ignore[arg-type]
    error = caught.value
    assert (error.status, error.kind) == (422, kind)
    assert f"'{tensor}'" in error.error
    assert error.detail["tensor"] == tensor
    return error


def test_a_matching_body_passes() -> None:
    check_tensors(_body(), SPECS, float_dtype=torch.float32)
    check_tensors(_body(torch.bfloat16), SPECS, float_dtype=torch.bfloat16)


def test_initial_weights_take_any_float_width_but_exact_int_and_bool() -> None:
    body = _body(torch.float16)
    body["b"] = body["b"].double()
    check_tensors(body, SPECS, float_dtype=None)
    body["n"] = torch.tensor(4.0)
    error = _rejected(body, "wrong_dtype", "n", float_dtype=None)
    assert error.error == "tensor 'n' has dtype float32, expected int64"


def test_pseudo_gradients_of_int_and_bool_buffers_travel_as_int64_never_bf16() -> None:
    """bf16 holds 8 bits of mantissa: a buffer difference of 257 would arrive as 256."""
    assert torch.tensor(257.0).to(torch.bfloat16).item() == 256.0
    body = _body(torch.bfloat16)
    body["n"] = torch.tensor(-257, dtype=torch.int64)
    body["m"] = torch.tensor([1, 0], dtype=torch.int64)
    check_tensors(body, SPECS, float_dtype=torch.bfloat16)
    body["n"] = torch.tensor(-257.0)  # fp32, as older workers sent it: exact to 2**24
    check_tensors(body, SPECS, float_dtype=torch.bfloat16)
    body["n"] = torch.tensor(-257.0, dtype=torch.bfloat16)
    error = _rejected(body, "wrong_dtype", "n", float_dtype=torch.bfloat16)
    assert error.error == "tensor 'n' has dtype bfloat16, expected int64 or float32"


def test_unknown_tensor() -> None:
    body = {**_body(), "extra.weight": torch.ones(1)}
    error = _rejected(body, "unknown_tensor", "extra.weight")
    assert error.error == "tensor 'extra.weight' is not in the model"


def test_missing_tensor_unless_a_subset_is_allowed() -> None:
    body = _body()
    del body["b"]
    _rejected(body, "missing_tensor", "b")
    check_tensors(body, SPECS, float_dtype=torch.float32, require_all=False)


def test_wrong_shape() -> None:
    body = {**_body(), "w": torch.ones(3, 2)}
    error = _rejected(body, "wrong_shape", "w")
    assert error.error == "tensor 'w' has shape [3, 2], the model expects [2, 3]"
    assert (error.detail["expected"], error.detail["got"]) == ([2, 3], [3, 2])


def test_wrong_float_width() -> None:
    error = _rejected(_body(torch.float32), "wrong_dtype", "w", float_dtype=torch.bfloat16)
    assert error.error == "tensor 'w' has dtype float32, expected bfloat16"


def test_int_where_a_float_belongs() -> None:
    body = {**_body(), "b": torch.zeros(3, dtype=torch.int64)}
    _rejected(body, "wrong_dtype", "b", float_dtype=None)


def test_int_of_another_width() -> None:
    body = {**_body(), "n": torch.tensor(4, dtype=torch.int32)}
    error = _rejected(body, "wrong_dtype", "n")
    assert (error.detail["expected"], error.detail["got"]) == ("int64 or float32", "int32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_the_tensor_and_counts(bad: float) -> None:
    body = _body()
    body["w"][0, 1] = bad
    body["w"][1, 2] = bad
    error = _rejected(body, "non_finite", "w")
    assert error.detail["count"] == 2
    assert "2 NaN or Inf values" in error.error


def test_non_finite_in_a_float_pseudo_gradient_of_an_int_buffer() -> None:
    body = {**_body(), "n": torch.tensor(float("nan"))}
    _rejected(body, "non_finite", "n")


def test_structure_is_checked_before_values() -> None:
    body = _body()
    body["w"][0, 0] = float("nan")
    body["b"] = torch.zeros(4)
    _rejected(body, "wrong_shape", "b")


def test_checks_do_not_mutate() -> None:
    body = _body(torch.bfloat16)
    body["w"][0, 0] = float("nan")
    before = {name: tensor.clone() for name, tensor in body.items()}
    with pytest.raises(WireError):
        check_tensors(body, SPECS, float_dtype=torch.bfloat16)
    for name, tensor in body.items():
        assert tensor.dtype == before[name].dtype
        assert torch.equal(tensor.nan_to_num(), before[name].nan_to_num())
