"""classify_tensors and to_fp32_masters."""

import torch

from diloco.algorithm import TensorKind, classify_tensors, to_fp32_masters


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.steps = torch.nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("count", torch.zeros((), dtype=torch.int32))
        self.register_buffer("mask", torch.ones(2, dtype=torch.bool))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_classify_tensors_by_parameter_gradient_and_dtype() -> None:
    kinds = classify_tensors(_Mixed())
    assert kinds == {
        "linear.weight": TensorKind.TRAINABLE,
        "linear.bias": TensorKind.TRAINABLE,
        "frozen": TensorKind.FROZEN,
        "steps": TensorKind.INT_BUFFER,
        "scale": TensorKind.FLOAT_BUFFER,
        "count": TensorKind.INT_BUFFER,
        "mask": TensorKind.BOOL_BUFFER,
    }


def test_classify_tensors_batchnorm() -> None:
    kinds = classify_tensors(torch.nn.BatchNorm1d(4))
    assert kinds["weight"] is TensorKind.TRAINABLE
    assert kinds["running_mean"] is TensorKind.FLOAT_BUFFER
    assert kinds["num_batches_tracked"] is TensorKind.INT_BUFFER


def test_classify_tensors_lists_tied_weights_under_each_key() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    kinds = classify_tensors(model)
    assert kinds == {"0.weight": TensorKind.TRAINABLE, "1.weight": TensorKind.TRAINABLE}


def test_tensor_kind_is_a_string() -> None:
    assert TensorKind("frozen") is TensorKind.FROZEN
    assert TensorKind.INT_BUFFER == "int_buffer"


def test_masters_are_fp32_copies_of_floats_and_keep_int_and_bool_dtypes() -> None:
    state = {
        "w": torch.tensor([1.5, 2.5], dtype=torch.bfloat16, requires_grad=True),
        "n": torch.tensor(7, dtype=torch.int64),
        "b": torch.tensor([True, False]),
        "t": torch.arange(6.0).reshape(2, 3).t(),
    }
    masters = to_fp32_masters(state)
    assert masters["w"].dtype == torch.float32
    assert not masters["w"].requires_grad
    assert masters["n"].dtype == torch.int64
    assert masters["b"].dtype == torch.bool
    assert masters["t"].is_contiguous()
    assert torch.equal(masters["t"], state["t"])
    masters["n"].add_(1)
    masters["t"].zero_()
    assert int(state["n"]) == 7
    assert float(state["t"].sum()) == 15.0
