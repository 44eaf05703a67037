"""Delayed Nesterov (Liu et al. 2024, Algorithm 3): reference vectors, state, validation."""

import pytest
import torch

from diloco.algorithm import (
    ARRIVALS_KEY,
    Contribution,
    DelayedNesterov,
    TensorKind,
    outer_step,
)


def _run(optimizer: DelayedNesterov, theta0: float, grads: list[float]) -> list[float]:
    params = {"w": torch.tensor(theta0)}
    trajectory = []
    for g in grads:
        optimizer.step(params, {"w": torch.tensor(g)})
        trajectory.append(float(params["w"]))
    return trajectory


def test_reference_n2_c0() -> None:
    trajectory = _run(DelayedNesterov(lr=0.7, momentum=0.9, delay=2), 1.0, [0.2, 0.4, 0.2, 0.4])
    assert trajectory == pytest.approx([0.93, 0.601, 0.531, 0.0319], abs=1e-6)


def test_reference_n2_c01() -> None:
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9, delay=2, c=0.1)
    trajectory = _run(optimizer, 1.0, [0.2, 0.4, 0.2, 0.4])
    assert trajectory == pytest.approx([0.93, 0.6199, 0.531, 0.06781], abs=1e-6)


def test_reference_n3_unit_gradients() -> None:
    trajectory = _run(DelayedNesterov(lr=1.0, momentum=0.9, delay=3), 0.0, [1.0, 1.0, 1.0])
    assert trajectory == pytest.approx([-1 / 3, -2 / 3, -1.9], abs=1e-6)


def test_n1_c0_is_plain_nesterov_like_pytorch() -> None:
    generator = torch.Generator().manual_seed(1)
    params = {"a": torch.randn(3, 2, generator=generator), "b": torch.randn(4, generator=generator)}
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    torch_sgd = torch.optim.SGD(list(reference.values()), lr=0.7, momentum=0.9, nesterov=True)
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9, delay=1, c=0.0)
    for _ in range(5):
        grads = {n: torch.randn(t.shape, generator=generator) for n, t in params.items()}
        for name, param in reference.items():
            param.grad = grads[name].clone()
        torch_sgd.step()
        optimizer.step(params, grads)
    for name, param in reference.items():
        torch.testing.assert_close(params[name], param.detach(), atol=1e-6, rtol=0)


def test_state_dict_round_trip_mid_cycle() -> None:
    first = DelayedNesterov(lr=0.7, momentum=0.9, delay=2, c=0.1)
    params = {"w": torch.tensor(1.0)}
    for g in (0.2, 0.4, 0.2):
        first.step(params, {"w": torch.tensor(g)})
    state = first.state_dict()
    assert state[ARRIVALS_KEY].dtype == torch.int64
    assert state[ARRIVALS_KEY].dim() == 0
    assert int(state[ARRIVALS_KEY]) == 3
    assert set(state) == {ARRIVALS_KEY, "momentum/w", "accumulated/w", "arrivals/w"}
    second = DelayedNesterov(lr=0.7, momentum=0.9, delay=2, c=0.1)
    second.load_state_dict(state)
    assert second.arrivals == 3
    copy = {"w": params["w"].clone()}
    first.step(params, {"w": torch.tensor(0.4)})
    second.step(copy, {"w": torch.tensor(0.4)})
    assert torch.equal(params["w"], copy["w"])
    assert float(copy["w"]) == pytest.approx(0.06781, abs=1e-6)


def test_load_state_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="'bogus'"):
        DelayedNesterov().load_state_dict({"bogus": torch.zeros(1)})


def test_names_cycle_on_their_own_arrivals() -> None:
    optimizer = DelayedNesterov(lr=1.0, momentum=0.9, delay=2)
    params = {"a": torch.tensor(0.0), "b": torch.tensor(0.0)}
    optimizer.step(params, {"a": torch.tensor(1.0)})
    optimizer.step(params, {"b": torch.tensor(1.0)})
    assert float(params["a"]) == pytest.approx(-0.5)
    assert float(params["b"]) == pytest.approx(-0.5)
    assert float(optimizer.state_dict()["momentum/a"]) == 0.0
    assert optimizer.arrivals == 2


def test_works_as_the_update_rule_of_outer_step() -> None:
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9, delay=2)
    masters = {"w": torch.tensor(1.0)}
    for g in (0.2, 0.4):
        outer_step(
            masters, [Contribution({"w": torch.tensor(g)})], optimizer, {"w": TensorKind.TRAINABLE}
        )
    assert float(masters["w"]) == pytest.approx(0.601, abs=1e-6)


def test_non_finite_gradient_is_rejected_before_any_change() -> None:
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9, delay=2)
    params = {"a": torch.tensor(1.0), "b": torch.tensor(1.0)}
    optimizer.step(params, {"a": torch.tensor(0.2), "b": torch.tensor(0.2)})
    before_params = {n: t.clone() for n, t in params.items()}
    before_state = optimizer.state_dict()
    with pytest.raises(ValueError, match="'b'"):
        optimizer.step(params, {"a": torch.tensor(0.4), "b": torch.tensor(float("nan"))})
    assert all(torch.equal(params[n], before_params[n]) for n in params)
    after_state = optimizer.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], before_state[k]) for k in before_state)


def test_describe() -> None:
    assert DelayedNesterov(delay=4, c=0.1).describe() == {
        "kind": "delayed_nesterov",
        "lr": 0.7,
        "momentum": 0.9,
        "delay": 4,
        "c": 0.1,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, r"lr must be > 0, got 0\.0"),
        ({"lr": -1.0}, r"lr must be > 0"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1\.0"),
        ({"momentum": -0.5}, r"momentum must be in \[0, 1\)"),
        ({"delay": 0}, r"delay must be an integer >= 1, got 0"),
        ({"delay": 1.5}, r"delay must be an integer >= 1"),
        ({"c": 1.5}, r"c must be in \[0, 1\], got 1\.5"),
        ({"c": -0.1}, r"c must be in \[0, 1\]"),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DelayedNesterov(**kwargs)


def test_divisors_give_the_step_of_the_divided_gradient() -> None:
    """The server hands a window's running sum and its total weight."""
    divided, stepped = {"w": torch.ones(5)}, {"w": torch.ones(5)}
    first = DelayedNesterov(lr=0.7, momentum=0.9, delay=2)
    second = DelayedNesterov(lr=0.7, momentum=0.9, delay=2)
    for value in (0.6, 1.2, 0.6):
        first.step(divided, {"w": torch.full((5,), value / 3)})
        second.step(stepped, {"w": torch.full((5,), value)}, divisors={"w": 3.0})
    torch.testing.assert_close(stepped["w"], divided["w"], rtol=1e-6, atol=0)


# Hand computations for N > 2, where the two readings of the c term differ. lr 1, beta 0.9,
# theta0 = 0, g = 1 at every arrival, so each arrival applies g / N = 1 / N plus its share
# of beta * m. Algorithm 3 of Liu et al. 2024: between momentum updates c * beta * m, at the
# N-th arrival m = beta m + (sum of the cycle's g) / N, then (1 - c (N - 1)) * beta * m.
#
# N = 4, c = 0.1: arrivals 1-3 move 0.25 each (m = 0): -0.25, -0.5, -0.75. Arrival 4: m = 1,
# moves 0.25 + 0.7 * 0.9 * 1 = 0.88: -1.63. Arrivals 5-7 move 0.25 + 0.1 * 0.9 * 1 = 0.34:
# -1.97, -2.31, -2.65. Arrival 8: m = 0.9 + 1 = 1.9, moves 0.25 + 0.7 * 0.9 * 1.9 = 1.447:
# -4.097. (The (1 - c) reading moved 0.25 + 0.81 = 1.06 at arrival 4: -1.81.)
N4_C01 = [-0.25, -0.5, -0.75, -1.63, -1.97, -2.31, -2.65, -4.097]
# N = 4, c = 0: arrival 4 moves 0.25 + 0.9 = 1.15 (-1.9), 5-7 move 0.25, arrival 8 moves
# 0.25 + 0.9 * 1.9 = 1.96: -4.61.
N4_C0 = [-0.25, -0.5, -0.75, -1.9, -2.15, -2.4, -2.65, -4.61]
# N = 8, c = 0.1: arrivals 1-7 move 0.125 (-0.875); arrival 8: m = 1, moves
# 0.125 + 0.3 * 0.9 = 0.395 (-1.27); arrivals 9-15 move 0.125 + 0.09 = 0.215 (-2.775);
# arrival 16: m = 1.9, moves 0.125 + 0.3 * 0.9 * 1.9 = 0.638: -3.413.
N8_C01_AT = {7: -0.875, 8: -1.27, 15: -2.775, 16: -3.413}


@pytest.mark.parametrize(
    ("delay", "c", "expected"),
    [
        (4, 0.1, dict(enumerate(N4_C01, start=1))),
        (4, 0.0, dict(enumerate(N4_C0, start=1))),
        (8, 0.1, N8_C01_AT),
    ],
)
def test_hand_computed_cycles_for_n_over_two(delay: int, c: float, expected: dict) -> None:
    trajectory = _run(DelayedNesterov(lr=1.0, momentum=0.9, delay=delay, c=c), 0.0, [1.0] * 16)
    for arrival, theta in expected.items():
        assert trajectory[arrival - 1] == pytest.approx(theta, abs=1e-6), arrival


@pytest.mark.parametrize("delay", [4, 8])
def test_c_does_not_change_how_far_constant_gradients_move_the_model(delay: int) -> None:
    """A cycle applies one beta * m in total whatever c, so in the steady state (m = g / (1 -
    beta) = 10) both runs move N / N + 0.9 * 10 = 10 per cycle. The (1 - c) reading applied
    (1 + c (N - 2)) beta m: 1.6x the momentum for N = 8, c = 0.1."""
    cycles = 300
    grads = [1.0] * (delay * cycles)
    with_c = _run(DelayedNesterov(lr=1.0, momentum=0.9, delay=delay, c=0.1), 0.0, grads)
    without = _run(DelayedNesterov(lr=1.0, momentum=0.9, delay=delay, c=0.0), 0.0, grads)
    last_cycle_with_c = with_c[-1] - with_c[-1 - delay]
    last_cycle_without = without[-1] - without[-1 - delay]
    assert last_cycle_with_c == pytest.approx(-10.0, rel=1e-4)
    assert last_cycle_without == pytest.approx(-10.0, rel=1e-4)
    assert with_c[-1] / without[-1] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize(("delay", "c"), [(2, 1.01), (4, 0.34), (8, 0.15), (3, -0.1)])
def test_c_past_one_over_n_minus_one_is_refused(delay: int, c: float) -> None:
    with pytest.raises(ValueError, match="delayed nesterov c"):
        DelayedNesterov(delay=delay, c=c)


def test_c_at_its_bound_applies_all_momentum_between_updates() -> None:
    """c = 1 / (N - 1): the N-th arrival applies none of beta * m (N = 3, c = 0.5)."""
    optimizer = DelayedNesterov(lr=1.0, momentum=0.9, delay=3, c=0.5)
    trajectory = _run(optimizer, 0.0, [1.0] * 6)
    # 1-3: -1/3 each (m = 0 until the 3rd, whose share 1 - 2 * 0.5 = 0); m = 1 then;
    # 4-5: -(1/3 + 0.45); 6: m = 1.9, -(1/3 + 0).
    assert trajectory == pytest.approx(
        [-1 / 3, -2 / 3, -1.0, -1.7833333, -2.5666667, -2.9], abs=1e-6
    )
