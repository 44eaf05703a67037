"""OuterOptimizer: reference vectors, PyTorch equivalence, momentum state, validation."""

import pytest
import torch

from diloco.algorithm import OuterOptimizer


def _scalar(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(value, dtype=torch.float32)}


def test_momentum_beta_half_moves_plus_two_then_plus_five() -> None:
    optimizer = OuterOptimizer("momentum", lr=1.0, momentum=0.5)
    params = _scalar(0.0)
    optimizer.step(params, _scalar(-2.0))  # L - G = +2
    assert float(params["w"]) == pytest.approx(2.0)
    optimizer.step(params, _scalar(-4.0))  # L - G = +4
    assert float(params["w"]) == pytest.approx(7.0)
    assert float(optimizer.state_dict()["w"]) == pytest.approx(-5.0)


def test_nesterov_beta_half_moves_plus_three_then_plus_six_and_a_half() -> None:
    optimizer = OuterOptimizer("nesterov", lr=1.0, momentum=0.5)
    params = _scalar(0.0)
    optimizer.step(params, _scalar(-2.0))
    assert float(params["w"]) == pytest.approx(3.0)
    optimizer.step(params, _scalar(-4.0))
    assert float(params["w"]) == pytest.approx(9.5)


@pytest.mark.parametrize(("kind", "momentum"), [("nesterov", 0.9), ("momentum", 0.8), ("sgd", 0)])
def test_matches_torch_sgd_on_random_tensors(kind: str, momentum: float) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (4, 3), "b": (5,), "c": ()}
    params = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    torch_sgd = torch.optim.SGD(
        list(reference.values()), lr=0.7, momentum=momentum, nesterov=kind == "nesterov"
    )
    optimizer = OuterOptimizer(kind, lr=0.7, momentum=momentum)
    for _ in range(6):
        grads = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
        for name, param in reference.items():
            param.grad = grads[name].clone()
        torch_sgd.step()
        optimizer.step(params, grads)
    for name, param in reference.items():
        torch.testing.assert_close(params[name], param.detach(), atol=1e-6, rtol=0)


def test_step_touches_only_the_names_given() -> None:
    optimizer = OuterOptimizer("nesterov", lr=1.0, momentum=0.9)
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    optimizer.step(params, {"a": torch.ones(2)})
    assert torch.equal(params["b"], torch.zeros(2))
    assert set(optimizer.state_dict()) == {"a"}


def test_state_dict_round_trip_continues_identically() -> None:
    first = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    params = _scalar(1.0)
    first.step(params, _scalar(0.3))
    second = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    second.load_state_dict(first.state_dict())
    copy = {"w": params["w"].clone()}
    first.step(params, _scalar(0.3))
    second.step(copy, _scalar(0.3))
    assert torch.equal(params["w"], copy["w"])
    assert float(params["w"]) == pytest.approx(0.0319, abs=1e-7)  # fp32: 0.601 - 0.5691


def test_state_dict_returns_copies() -> None:
    optimizer = OuterOptimizer("momentum", lr=1.0, momentum=0.5)
    optimizer.step(_scalar(0.0), _scalar(1.0))
    optimizer.state_dict()["w"].fill_(100.0)
    assert float(optimizer.state_dict()["w"]) == 1.0


def test_momentum_restarts_when_shape_changes() -> None:
    optimizer = OuterOptimizer("momentum", lr=1.0, momentum=0.5)
    optimizer.step({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    params = {"w": torch.zeros(3)}
    optimizer.step(params, {"w": torch.ones(3)})
    assert torch.equal(optimizer.state_dict()["w"], torch.ones(3))
    assert torch.equal(params["w"], -torch.ones(3))


def test_momentum_restarts_when_dtype_changes() -> None:
    optimizer = OuterOptimizer("momentum", lr=1.0, momentum=0.5)
    optimizer.load_state_dict({"w": torch.full((2,), 8.0, dtype=torch.float64)})
    params = {"w": torch.zeros(2)}
    optimizer.step(params, {"w": torch.ones(2)})
    assert optimizer.state_dict()["w"].dtype == torch.float32
    assert torch.equal(params["w"], -torch.ones(2))


def test_reset_drops_one_name() -> None:
    optimizer = OuterOptimizer("momentum", lr=1.0, momentum=0.5)
    params = {"a": torch.zeros(()), "b": torch.zeros(())}
    optimizer.step(params, {"a": torch.tensor(1.0), "b": torch.tensor(1.0)})
    optimizer.reset("a")
    assert set(optimizer.state_dict()) == {"b"}
    optimizer.reset()
    assert optimizer.state_dict() == {}


def test_sgd_has_no_state() -> None:
    optimizer = OuterOptimizer("sgd", lr=0.5)
    params = _scalar(1.0)
    optimizer.step(params, _scalar(1.0))
    assert float(params["w"]) == 0.5
    assert optimizer.state_dict() == {}


def test_describe_and_defaults() -> None:
    assert OuterOptimizer().describe() == {"kind": "nesterov", "lr": 0.7, "momentum": 0.9}
    assert OuterOptimizer("sgd").describe() == {"kind": "sgd", "lr": 0.7, "momentum": 0.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"outer lr must be > 0, got -1\.0"),
        ({"lr": 0.0}, r"outer lr must be > 0"),
        ({"lr": float("nan")}, r"outer lr must be > 0"),
        ({"lr": float("inf")}, r"outer lr must be > 0"),
        ({"momentum": 1.0}, r"outer momentum must be in \[0, 1\), got 1\.0"),
        ({"momentum": -0.1}, r"outer momentum must be in \[0, 1\)"),
        ({"kind": "momentum", "momentum": 1.5}, r"outer momentum must be in \[0, 1\)"),
        ({"kind": "sgd", "momentum": 0.9}, r"outer momentum must be 0 for kind 'sgd'"),
        (
            {"kind": "adam"},
            r"outer optimizer kind must be one of 'sgd', 'momentum', 'nesterov', got 'adam'",
        ),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OuterOptimizer(**kwargs)


def test_bad_step_inputs_leave_everything_unchanged() -> None:
    optimizer = OuterOptimizer("nesterov", lr=1.0, momentum=0.9)
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    optimizer.step(params, {"a": torch.ones(2), "b": torch.ones(2)})
    before_params = {n: t.clone() for n, t in params.items()}
    before_state = optimizer.state_dict()
    bad_inputs = [
        ({"a": torch.ones(2), "zz": torch.ones(2)}, "'zz'"),
        ({"a": torch.ones(2), "b": torch.ones(3)}, "'b'"),
        ({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])}, "'b'"),
    ]
    for grads, name in bad_inputs:
        with pytest.raises(ValueError, match=name):
            optimizer.step(params, grads)
    for name, tensor in before_params.items():
        assert torch.equal(params[name], tensor)
    after_state = optimizer.state_dict()
    assert all(torch.equal(after_state[n], before_state[n]) for n in before_state)


@pytest.mark.parametrize(("kind", "momentum"), [("nesterov", 0.9), ("momentum", 0.8), ("sgd", 0)])
def test_strided_tensors_take_the_unfused_path_to_the_same_weights(
    kind: str, momentum: float
) -> None:
    """The fused kernel is for contiguous memory only; a strided view must not be corrupted."""
    generator = torch.Generator().manual_seed(4)
    start = torch.randn(6, 4, generator=generator)
    grads = [torch.randn(6, 4, generator=generator) for _ in range(3)]
    contiguous = {"w": start.clone()}
    storage = torch.zeros(6, 8)
    storage[:, ::2] = start
    strided = {"w": storage[:, ::2]}  # every other column of a larger tensor
    fused = OuterOptimizer(kind, lr=0.7, momentum=momentum)
    unfused = OuterOptimizer(kind, lr=0.7, momentum=momentum)
    for grad in grads:
        fused.step(contiguous, {"w": grad})
        unfused.step(strided, {"w": grad.t().contiguous().t()})  # a strided grad too
    torch.testing.assert_close(strided["w"], contiguous["w"], rtol=1e-6, atol=1e-6)
    assert torch.equal(storage[:, 1::2], torch.zeros(6, 4))  # the columns between untouched
    if kind != "sgd":
        torch.testing.assert_close(
            unfused.state_dict()["w"], fused.state_dict()["w"], rtol=1e-6, atol=1e-6
        )
