"""pseudo_gradient, average_contributions and outer_step (the round both server and sim run)."""

import pytest
import torch

from diloco.algorithm import (
    Contribution,
    OuterOptimizer,
    TensorKind,
    average_contributions,
    is_finite_contribution,
    outer_step,
    pseudo_gradient,
)
from diloco.algorithm.outer import pseudo_gradient_into

TRAINABLE = {"w": TensorKind.TRAINABLE}


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _round(
    base: float,
    locals_: list[float],
    optimizer: OuterOptimizer,
    tokens: list[int] | None = None,
    weighting: str = "uniform",
) -> dict[str, torch.Tensor]:
    masters = {"w": _scalar(base)}
    contributions = [
        Contribution(
            pseudo_gradient(masters, {"w": _scalar(local)}),
            tokens=1 if tokens is None else tokens[i],
            worker=f"w{i}",
        )
        for i, local in enumerate(locals_)
    ]
    outer_step(masters, contributions, optimizer, TRAINABLE, weighting=weighting)
    return masters


def _sgd(lr: float = 1.0) -> OuterOptimizer:
    return OuterOptimizer("sgd", lr=lr, momentum=0.0)


def _snapshot(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in masters.items()}


def _assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype
        assert torch.equal(left[name], right[name]), name


# --- Reference vectors ---------------------------------------------------------------------


def test_sign_local_above_anchor_gives_negative_pseudo_gradient() -> None:
    g = pseudo_gradient({"w": _scalar(3.0)}, {"w": _scalar(5.0)})
    assert float(g["w"]) == -2.0


def test_outer_sgd_lr_one_uniform_is_fedavg() -> None:
    assert float(_round(10.0, [12.0, 18.0], _sgd())["w"]) == pytest.approx(15.0)


def test_outer_sgd_token_weighting() -> None:
    masters = {"w": _scalar(10.0)}
    contributions = [
        Contribution({"w": _scalar(-2.0)}, tokens=1),
        Contribution({"w": _scalar(-8.0)}, tokens=3),
    ]
    assert float(average_contributions(contributions, "tokens")["w"]) == pytest.approx(-6.5)
    outer_step(masters, contributions, _sgd(), TRAINABLE, weighting="tokens")
    assert float(masters["w"]) == pytest.approx(16.5)


def test_outer_sgd_lr_half() -> None:
    assert float(_round(10.0, [12.0, 18.0], _sgd(0.5))["w"]) == pytest.approx(12.5)


def test_nesterov_two_rounds_reference() -> None:
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    masters = {"w": _scalar(1.0)}
    for expected in (0.601, 0.0319):
        anchor = float(masters["w"])
        contributions = [
            Contribution(pseudo_gradient(masters, {"w": _scalar(anchor - g)}), worker=str(i))
            for i, g in enumerate((0.2, 0.4))
        ]
        result = outer_step(masters, contributions, optimizer, TRAINABLE)
        assert result.contributors == 2
        assert result.updated == ["w"]
        assert float(masters["w"]) == pytest.approx(expected, abs=1e-6)


# --- pseudo_gradient -----------------------------------------------------------------------


def test_pseudo_gradient_is_fp32_for_floats_and_exact_int64_for_buffers() -> None:
    anchor = {
        "h": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "n": torch.tensor(2**40 + 3, dtype=torch.int64),
        "b": torch.tensor([True, False]),
    }
    local = {
        "h": torch.tensor([0.5, 2.0], dtype=torch.bfloat16),
        "n": torch.tensor(2**40 + 1, dtype=torch.int64),
        "b": torch.tensor([False, True]),
    }
    g = pseudo_gradient(anchor, local)
    assert {name: t.dtype for name, t in g.items()} == {
        "h": torch.float32,
        "n": torch.int64,
        "b": torch.int64,
    }
    assert g["h"].tolist() == [0.5, 0.0]
    assert int(g["n"]) == 2  # exact despite values beyond float32 precision
    assert g["b"].tolist() == [1, -1]


def test_pseudo_gradient_into_writes_the_same_values_in_place() -> None:
    anchor = {
        "h": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "w": torch.tensor([[1.0, 2.5], [0.0, -1.0]]).t(),  # strided
        "n": torch.tensor(2**40 + 3, dtype=torch.int64),
        "b": torch.tensor([True, False]),
    }
    local = {
        "h": torch.tensor([0.5, 2.0], dtype=torch.bfloat16),
        "w": torch.tensor([[0.5, 3.0], [0.25, -1.0]]).t(),
        "n": torch.tensor(2**40 + 1, dtype=torch.int64),
        "b": torch.tensor([False, True]),
    }
    out = {
        "h": torch.full((2,), 9.0),
        "w": torch.full((2, 2), 9.0),
        "n": torch.tensor(9, dtype=torch.int64),
        "b": torch.full((2,), 9, dtype=torch.int64),
    }
    pseudo_gradient_into(anchor, local, out)
    assert out["h"].tolist() == [0.5, 0.0]
    assert out["w"].tolist() == [[0.5, -0.25], [-0.5, 0.0]]
    assert int(out["n"]) == 2 and out["b"].tolist() == [1, -1]
    with pytest.raises(ValueError, match=r"'w': the output is torch.float64, expected"):
        pseudo_gradient_into(anchor, local, {"w": torch.zeros(2, 2, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"'w' has shape \(2, 2\) in the anchor, \(2, 2\) loc"):
        pseudo_gradient_into(anchor, local, {"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="'extra'"):
        pseudo_gradient_into(
            {"w": torch.zeros(2)}, {"w": torch.zeros(2), "extra": torch.zeros(1)}, {}
        )


def test_pseudo_gradient_names_the_mismatching_tensor() -> None:
    with pytest.raises(ValueError, match="'extra'"):
        pseudo_gradient({"w": torch.zeros(2)}, {"w": torch.zeros(2), "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="'w'"):
        pseudo_gradient({"w": torch.zeros(2)}, {"w": torch.zeros(3)})


# --- average_contributions -----------------------------------------------------------------


def test_average_is_per_name_over_the_contributions_that_carry_it() -> None:
    contributions = [
        Contribution({"a": _scalar(1.0), "b": _scalar(10.0)}),
        Contribution({"a": _scalar(3.0)}),
    ]
    mean = average_contributions(contributions)
    assert float(mean["a"]) == 2.0
    assert float(mean["b"]) == 10.0


def test_token_weighting_ignores_non_positive_tokens() -> None:
    contributions = [
        Contribution({"a": _scalar(1.0)}, tokens=2),
        Contribution({"a": _scalar(100.0)}, tokens=0),
        Contribution({"a": _scalar(100.0)}, tokens=-5),
    ]
    assert float(average_contributions(contributions, "tokens")["a"]) == 1.0
    assert float(average_contributions(contributions, "uniform")["a"]) == pytest.approx(67.0)


def test_average_of_nothing_is_empty() -> None:
    assert average_contributions([]) == {}


def test_average_result_is_fp32_and_does_not_alias_inputs() -> None:
    tensor = torch.ones(2, dtype=torch.float32)
    mean = average_contributions([Contribution({"a": tensor})])
    mean["a"].fill_(5.0)
    assert torch.equal(tensor, torch.ones(2))
    half = average_contributions([Contribution({"a": torch.ones(2, dtype=torch.float16)})])
    assert half["a"].dtype == torch.float32


def test_average_rejects_unknown_weighting_and_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"weighting must be one of 'uniform', 'tokens'"):
        average_contributions([], weighting="loss")
    with pytest.raises(ValueError, match="'a'"):
        average_contributions(
            [Contribution({"a": torch.zeros(2)}), Contribution({"a": torch.zeros(3)})]
        )


def test_is_finite_contribution() -> None:
    assert is_finite_contribution(Contribution({"a": torch.ones(2), "n": torch.ones(2).long()}))
    assert not is_finite_contribution(Contribution({"a": torch.tensor([1.0, float("inf")])}))
    assert not is_finite_contribution(Contribution({"a": torch.tensor(float("nan"))}))


# --- Apply policy --------------------------------------------------------------------------


def _policy_masters() -> dict[str, torch.Tensor]:
    return {
        "trainable": _scalar(1.0),
        "frozen": _scalar(1.0),
        "float_buffer": _scalar(1.0),
        "int_a": torch.tensor(1, dtype=torch.int64),
        "int_b": torch.tensor(2, dtype=torch.int32),
        "bool_half": torch.tensor(True),
        "bool_low": torch.tensor(True),
    }


POLICY_KINDS = {
    "trainable": TensorKind.TRAINABLE,
    "frozen": TensorKind.FROZEN,
    "float_buffer": TensorKind.FLOAT_BUFFER,
    "int_a": TensorKind.INT_BUFFER,
    "int_b": TensorKind.INT_BUFFER,
    "bool_half": TensorKind.BOOL_BUFFER,
    "bool_low": TensorKind.BOOL_BUFFER,
}


def _policy_contributions(masters: dict[str, torch.Tensor]) -> list[Contribution]:
    locals_ = [
        {
            "trainable": _scalar(0.0),
            "frozen": _scalar(0.0),
            "float_buffer": _scalar(0.0),
            "int_a": torch.tensor(1, dtype=torch.int64),
            "int_b": torch.tensor(2, dtype=torch.int32),
            "bool_half": torch.tensor(True),
            "bool_low": torch.tensor(True),
        },
        {
            "trainable": _scalar(2.0),
            "frozen": _scalar(3.0),
            "float_buffer": _scalar(5.0),
            "int_a": torch.tensor(2, dtype=torch.int64),
            "int_b": torch.tensor(3, dtype=torch.int32),
            "bool_half": torch.tensor(False),
            "bool_low": torch.tensor(False),
        },
        {
            "trainable": _scalar(1.0),
            "frozen": _scalar(0.0),
            "float_buffer": _scalar(1.0),
            "int_a": torch.tensor(1, dtype=torch.int64),
            "int_b": torch.tensor(2, dtype=torch.int32),
            "bool_half": torch.tensor(True),
            "bool_low": torch.tensor(False),
        },
        {
            "trainable": _scalar(1.0),
            "frozen": _scalar(1.0),
            "float_buffer": _scalar(2.0),
            "int_a": torch.tensor(2, dtype=torch.int64),
            "int_b": torch.tensor(3, dtype=torch.int32),
            "bool_half": torch.tensor(False),
            "bool_low": torch.tensor(False),
        },
    ]
    return [Contribution(pseudo_gradient(masters, local)) for local in locals_]


def test_default_policy_per_kind() -> None:
    masters = _policy_masters()
    optimizer = OuterOptimizer("momentum", lr=0.5, momentum=0.9)
    contributions = _policy_contributions(masters)
    outer_step(masters, contributions, optimizer, POLICY_KINDS)
    # trainable: mean local 1.0, mean g = 0, stays 1.0 only through the optimizer
    assert float(masters["trainable"]) == 1.0
    assert set(optimizer.state_dict()) == {"trainable"}
    assert float(masters["frozen"]) == 1.0  # mean of 0, 3, 0, 1
    assert float(masters["float_buffer"]) == 2.0  # mean of 0, 5, 1, 2
    assert int(masters["int_a"]) == 2  # mean 1.5 rounds half to even -> 2
    assert int(masters["int_b"]) == 2  # mean 2.5 rounds half to even -> 2
    assert masters["int_a"].dtype == torch.int64
    assert masters["int_b"].dtype == torch.int32
    assert bool(masters["bool_half"]) is True  # mean exactly 0.5
    assert bool(masters["bool_low"]) is False  # mean 0.25
    assert masters["bool_half"].dtype == torch.bool


def test_default_policy_frozen_and_buffer_ignore_the_optimizer_lr() -> None:
    masters = {"frozen": _scalar(0.0), "buf": _scalar(0.0), "p": _scalar(0.0)}
    kinds = {"frozen": TensorKind.FROZEN, "buf": TensorKind.FLOAT_BUFFER, "p": TensorKind.TRAINABLE}
    local = {"frozen": _scalar(4.0), "buf": _scalar(4.0), "p": _scalar(4.0)}
    outer_step(masters, [Contribution(pseudo_gradient(masters, local))], _sgd(0.5), kinds)
    assert float(masters["frozen"]) == 4.0
    assert float(masters["buf"]) == 4.0
    assert float(masters["p"]) == 2.0


def test_all_floating_policy_sends_frozen_and_float_buffers_through_the_optimizer() -> None:
    masters = _policy_masters()
    optimizer = OuterOptimizer("sgd", lr=0.5, momentum=0.0)
    outer_step(
        masters, _policy_contributions(masters), optimizer, POLICY_KINDS, policy="all_floating"
    )
    assert float(masters["frozen"]) == 1.0  # 1 - 0.5 * (1 - 1)
    assert float(masters["float_buffer"]) == 1.5  # moves half way from 1 toward the mean 2
    assert int(masters["int_a"]) == 2
    assert bool(masters["bool_half"]) is True


def test_all_floating_policy_keeps_momentum_for_buffers() -> None:
    masters = _policy_masters()
    optimizer = OuterOptimizer("momentum", lr=0.5, momentum=0.9)
    outer_step(
        masters, _policy_contributions(masters), optimizer, POLICY_KINDS, policy="all_floating"
    )
    assert set(optimizer.state_dict()) == {"trainable", "frozen", "float_buffer"}


# --- Partial rounds and invalid contributions ----------------------------------------------


def test_round_with_only_non_finite_contributions_changes_nothing() -> None:
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    masters = {"w": _scalar(1.0)}
    outer_step(masters, [Contribution({"w": _scalar(0.3)})], optimizer, TRAINABLE)
    weights, momentum = _snapshot(masters), optimizer.state_dict()
    bad = [
        Contribution({"w": _scalar(float("nan"))}, worker="a"),
        Contribution({"w": _scalar(float("inf"))}, worker="b"),
        Contribution({"w": _scalar(float("-inf"))}),
    ]
    result = outer_step(masters, bad, optimizer, TRAINABLE)
    assert result.contributors == 0
    assert result.updated == []
    assert result.skipped_workers == ["a", "b", "#2"]
    _assert_same(masters, weights)
    _assert_same(optimizer.state_dict(), momentum)


def test_round_with_no_contribution_changes_nothing() -> None:
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    masters = {"w": _scalar(1.0)}
    outer_step(masters, [Contribution({"w": _scalar(0.3)})], optimizer, TRAINABLE)
    weights, momentum = _snapshot(masters), optimizer.state_dict()
    result = outer_step(masters, [], optimizer, TRAINABLE)
    assert result.contributors == 0
    _assert_same(masters, weights)
    _assert_same(optimizer.state_dict(), momentum)


def test_non_finite_contribution_is_skipped_and_the_rest_applied() -> None:
    masters = {"w": _scalar(10.0)}
    contributions = [
        Contribution({"w": _scalar(-2.0)}, worker="good"),
        Contribution({"w": _scalar(float("nan"))}, worker="bad"),
        Contribution({"w": _scalar(-8.0)}, worker="good2"),
    ]
    result = outer_step(masters, contributions, _sgd(), TRAINABLE)
    assert result.contributors == 2
    assert result.skipped_workers == ["bad"]
    assert float(masters["w"]) == 15.0


def test_token_weighting_leaves_out_zero_token_contributions() -> None:
    masters = {"w": _scalar(10.0)}
    contributions = [
        Contribution({"w": _scalar(-2.0)}, tokens=4),
        Contribution({"w": _scalar(-100.0)}, tokens=0),
    ]
    result = outer_step(masters, contributions, _sgd(), TRAINABLE, weighting="tokens")
    assert result.contributors == 1
    assert result.skipped_workers == []
    assert float(masters["w"]) == 12.0


def test_names_nobody_sent_keep_weights_and_momentum() -> None:
    kinds = {"a": TensorKind.TRAINABLE, "b": TensorKind.TRAINABLE}
    optimizer = OuterOptimizer("nesterov", lr=1.0, momentum=0.9)
    masters = {"a": _scalar(0.0), "b": _scalar(0.0)}
    outer_step(masters, [Contribution({"a": _scalar(1.0), "b": _scalar(1.0)})], optimizer, kinds)
    b_weight, b_momentum = masters["b"].clone(), optimizer.state_dict()["b"]
    result = outer_step(masters, [Contribution({"a": _scalar(1.0)})], optimizer, kinds)
    assert result.updated == ["a"]
    assert torch.equal(masters["b"], b_weight)
    assert torch.equal(optimizer.state_dict()["b"], b_momentum)


def test_name_only_some_workers_send_is_averaged_over_those() -> None:
    kinds = {"a": TensorKind.TRAINABLE, "b": TensorKind.TRAINABLE}
    masters = {"a": _scalar(0.0), "b": _scalar(0.0)}
    contributions = [
        Contribution({"a": _scalar(-1.0), "b": _scalar(-6.0)}),
        Contribution({"a": _scalar(-3.0)}),
    ]
    outer_step(masters, contributions, _sgd(), kinds)
    assert float(masters["a"]) == 2.0
    assert float(masters["b"]) == 6.0


def test_updated_lists_names_in_master_order() -> None:
    kinds = dict.fromkeys("abc", TensorKind.TRAINABLE)
    masters = {name: _scalar(0.0) for name in "abc"}
    contribution = Contribution({"c": _scalar(1.0), "a": _scalar(1.0)})
    assert outer_step(masters, [contribution], _sgd(), kinds).updated == ["a", "c"]


@pytest.mark.parametrize(
    ("pseudo_gradients", "message"),
    [
        ({"w": _scalar(1.0), "ghost": _scalar(1.0)}, "'ghost'"),
        ({"w": _scalar(1.0), "v": torch.zeros(3)}, "'v'"),
        ({"w": _scalar(1.0), "nokind": _scalar(1.0)}, "'nokind'"),
    ],
)
def test_errors_are_raised_before_anything_changes(
    pseudo_gradients: dict[str, torch.Tensor], message: str
) -> None:
    kinds = {"w": TensorKind.TRAINABLE, "v": TensorKind.TRAINABLE, "i": TensorKind.INT_BUFFER}
    masters = {"w": _scalar(1.0), "v": torch.zeros(2), "i": torch.tensor(3), "nokind": _scalar(0)}
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    outer_step(masters, [Contribution({"w": _scalar(0.5)})], optimizer, kinds)
    weights, momentum = _snapshot(masters), optimizer.state_dict()
    contributions = [
        Contribution({"w": _scalar(0.5), "i": torch.tensor(1.0)}, worker="fine"),
        Contribution(pseudo_gradients, worker="broken"),
    ]
    with pytest.raises(ValueError, match=message):
        outer_step(masters, contributions, optimizer, kinds)
    _assert_same(masters, weights)
    _assert_same(optimizer.state_dict(), momentum)


def test_trainable_kind_on_an_integer_master_is_an_error() -> None:
    masters = {"n": torch.tensor(3)}
    with pytest.raises(ValueError, match="'n'"):
        outer_step(
            masters, [Contribution({"n": _scalar(1.0)})], _sgd(), TRAINABLE | {"n": "trainable"}
        )
    assert int(masters["n"]) == 3


def test_unknown_policy_and_weighting_name_the_allowed_values() -> None:
    masters = {"w": _scalar(1.0)}
    with pytest.raises(ValueError, match=r"apply policy must be one of 'default', 'all_floating'"):
        outer_step(masters, [], _sgd(), TRAINABLE, policy="everything")
    with pytest.raises(ValueError, match=r"weighting must be one of 'uniform', 'tokens'"):
        outer_step(masters, [], _sgd(), TRAINABLE, weighting="loss")


def test_running_mean_folded_one_by_one_equals_outer_step_on_the_list() -> None:
    """The server folds submissions in as they arrive; the result must be the simulator's."""
    from diloco.algorithm import RunningMean, apply_mean

    generator = torch.Generator().manual_seed(5)
    start = {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}
    kinds = dict.fromkeys(start, "trainable")
    contributions = [
        Contribution(
            {n: torch.randn(t.shape, generator=generator) for n, t in start.items()},
            tokens=tokens,
            worker=str(i),
        )
        for i, tokens in enumerate([1, 3, 2])
    ]
    listed = {n: t.clone() for n, t in start.items()}
    outer_step(
        listed,
        contributions,
        OuterOptimizer("nesterov", lr=0.7, momentum=0.9),
        kinds,
        weighting="tokens",
    )
    folded = {n: t.clone() for n, t in start.items()}
    running = RunningMean("tokens")
    for contribution in contributions:
        assert running.add(contribution)
    assert running.count == 3
    updated = apply_mean(
        folded, running.mean(), OuterOptimizer("nesterov", lr=0.7, momentum=0.9), kinds
    )
    assert updated == ["w", "b"]
    for name in start:
        torch.testing.assert_close(folded[name], listed[name], rtol=1e-6, atol=1e-7)


def test_running_mean_rejects_a_shape_change_without_folding_anything() -> None:
    from diloco.algorithm import RunningMean

    running = RunningMean()
    running.add(Contribution({"w": torch.ones(2), "v": torch.ones(1)}))
    with pytest.raises(ValueError, match="'w' has shape"):
        running.add(Contribution({"v": torch.ones(1), "w": torch.ones(3)}))
    assert running.count == 1
    torch.testing.assert_close(running.mean()["v"], torch.ones(1))


def test_running_mean_ignores_zero_token_contributions_under_token_weighting() -> None:
    from diloco.algorithm import RunningMean

    running = RunningMean("tokens")
    assert not running.add(Contribution({"w": torch.ones(2)}, tokens=0))
    assert running.count == 0 and running.mean() == {}
