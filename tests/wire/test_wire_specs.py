"""Tensor specs, the model fingerprint and the first difference between two models."""

import hashlib
import json

import pytest
import torch

from diloco.algorithm import TensorKind, classify_tensors
from diloco.wire import TensorSpec, WireError, fingerprint, first_difference, specs_of


def _spec(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> TensorSpec:
    kind = "trainable" if dtype.is_floating_point else "int_buffer"
    return TensorSpec(name=name, shape=shape, dtype=dtype, kind=kind)


def test_specs_of_follows_model_order_and_kinds() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()
    specs = specs_of(state, classify_tensors(model))
    assert [spec.name for spec in specs] == list(state)
    by_name = {spec.name: spec for spec in specs}
    assert by_name["0.weight"] == TensorSpec("0.weight", (2, 3), torch.float32, "trainable")
    assert by_name["1.running_mean"].kind == "float_buffer"
    assert by_name["1.num_batches_tracked"] == TensorSpec(
        "1.num_batches_tracked", (), torch.int64, "int_buffer"
    )


def test_specs_of_accepts_kind_strings_and_needs_a_kind_for_every_tensor() -> None:
    state = {"w": torch.zeros(2), "n": torch.zeros((), dtype=torch.int32)}
    specs = specs_of(state, {"w": "frozen", "n": TensorKind.INT_BUFFER})
    assert [spec.kind for spec in specs] == ["frozen", "int_buffer"]
    with pytest.raises(ValueError, match="'n' has no kind"):
        specs_of(state, {"w": "frozen"})


def test_spec_json_round_trip() -> None:
    spec = TensorSpec("blocks.0.ln.weight", (64,), torch.bfloat16, "trainable")
    data = spec.to_json()
    assert data == {
        "name": "blocks.0.ln.weight",
        "shape": [64],
        "dtype": "bfloat16",
        "kind": "trainable",
    }
    assert TensorSpec.from_json(json.loads(json.dumps(data))) == spec


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "", "shape": [1], "dtype": "float32", "kind": "trainable"}, "name"),
        ({"name": "w", "shape": [1, -1], "dtype": "float32", "kind": "trainable"}, "shape"),
        ({"name": "w", "shape": [True], "dtype": "float32", "kind": "trainable"}, "shape"),
        ({"name": "w", "shape": "1", "dtype": "float32", "kind": "trainable"}, "shape"),
        ({"name": "w", "shape": [1], "dtype": "fp32", "kind": "trainable"}, "dtype"),
        ({"name": "w", "shape": [1], "dtype": "float32", "kind": "weights"}, "kind"),
        ({"name": "w", "shape": [1], "dtype": "float32", "kind": "frozen", "x": 1}, "x"),
    ],
)
def test_spec_from_json_names_the_bad_field(data: dict, field: str) -> None:
    with pytest.raises(WireError) as caught:
        TensorSpec.from_json(data)
    assert caught.value.status == 422
    assert caught.value.kind == "invalid_request"
    assert caught.value.detail["field"] == field


def test_fingerprint_is_the_documented_hash() -> None:
    specs = [_spec("step", (), torch.int64), _spec("head.weight", (256, 64), torch.bfloat16)]
    text = '[["head.weight",[256,64],"float32"],["step",[],"int64"]]'
    assert fingerprint(specs) == hashlib.sha256(text.encode()).hexdigest()


def test_fingerprint_ignores_order_and_float_width_but_not_int_width() -> None:
    fp32 = [_spec("a", (2, 3)), _spec("b", (4,)), _spec("n", (), torch.int64)]
    bf16 = [_spec("n", (), torch.int64), _spec("b", (4,), torch.bfloat16), _spec("a", (2, 3))]
    assert fingerprint(fp32) == fingerprint(bf16)
    assert fingerprint(fp32) == fingerprint(list(fp32))
    int32 = [_spec("a", (2, 3)), _spec("b", (4,)), _spec("n", (), torch.int32)]
    assert fingerprint(fp32) != fingerprint(int32)
    assert fingerprint(fp32) != fingerprint([_spec("a", (3, 2)), *fp32[1:]])
    assert len(fingerprint(fp32)) == 64


def test_first_difference_none_when_only_float_width_and_order_differ() -> None:
    model = [_spec("a", (2,)), _spec("n", (), torch.int64)]
    worker = [_spec("n", (), torch.int64), _spec("a", (2,), torch.float16)]
    assert first_difference(model, worker) is None


def test_first_difference_names_a_shape_mismatch() -> None:
    model = [_spec("blocks.0.attn.qkv.weight", (192, 64))]
    worker = [_spec("blocks.0.attn.qkv.weight", (96, 32))]
    assert first_difference(model, worker) == (
        "tensor 'blocks.0.attn.qkv.weight' has shape [96, 32], the model has [192, 64]"
    )


def test_first_difference_reports_the_first_name_in_sorted_order() -> None:
    model = [_spec("z", (1,)), _spec("b", (2,)), _spec("c", (3,))]
    worker = [_spec("z", (9,)), _spec("a", (1,)), _spec("c", (3,))]
    message = first_difference(model, worker)
    assert message == "tensor 'a' is not in the model"
    message = first_difference(model, [_spec("z", (1,)), _spec("c", (3,))])
    assert message == "tensor 'b' is missing; the model has it with shape [2] and dtype float32"


def test_first_difference_names_a_dtype_class_mismatch() -> None:
    model = [_spec("n", (), torch.int64), _spec("w", (2,))]
    message = first_difference(model, [_spec("n", (), torch.int32), _spec("w", (2,))])
    assert message == "tensor 'n' has dtype int32, the model has int64"
    message = first_difference(model, [_spec("n", (), torch.int64), _spec("w", (2,), torch.int64)])
    assert message == "tensor 'w' has dtype int64, the model has a floating dtype (float32)"
    message = first_difference(model, [_spec("n", (), torch.float32), _spec("w", (2,))])
    assert message == "tensor 'n' has dtype float32, the model has int64"
