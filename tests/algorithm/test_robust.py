"""Robust aggregation rules, every expected value worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.algorithm import TensorKind
from diloco.algorithm.robust import Aggregation, NormHistory, aggregate, update_norm

KINDS = {"w": TensorKind.TRAINABLE, "count": TensorKind.INT_BUFFER}


def grads(*rows: list[float]) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.tensor(row)} for row in rows]


def test_median_takes_the_middle_value_per_element_and_the_middle_pair_for_even_k() -> None:
    three = grads([1.0, -5.0], [2.0, 0.0], [100.0, 7.0])
    # element 0: 1, 2, 100 -> 2; element 1: -5, 0, 7 -> 0
    assert aggregate(three, KINDS, Aggregation.parse("median"))["w"].tolist() == [2.0, 0.0]
    four = grads([1.0], [2.0], [3.0], [100.0])
    assert aggregate(four, KINDS, Aggregation.parse("median"))["w"].tolist() == [2.5]  # (2+3)/2


def test_trimmed_mean_drops_floor_f_k_values_from_each_end() -> None:
    four = grads([1.0], [2.0], [3.0], [100.0])
    # F = 0.25, K = 4: one dropped from each end -> (2 + 3) / 2
    assert aggregate(four, KINDS, Aggregation.parse("trimmed_mean:0.25"))["w"].tolist() == [2.5]
    # F = 0.2, K = 4: floor(0.8) = 0 dropped -> the plain mean (1 + 2 + 3 + 100) / 4
    assert aggregate(four, KINDS, Aggregation.parse("trimmed_mean:0.2"))["w"].tolist() == [26.5]


def test_sparse_mean_averages_each_element_over_the_workers_that_sent_it() -> None:
    three = grads([3.0, 0.0, 0.0, 1.0], [0.0, 0.0, -4.0, 2.0], [6.0, 0.0, 0.0, 3.0])
    # element 0: 3 and 6 sent -> 4.5; element 1: nobody -> 0; element 2: -4 alone -> -4;
    # element 3: all three -> (1 + 2 + 3) / 3 = 2 (the plain mean would give 3, 0, -4/3, 2)
    combined = aggregate(three, KINDS, Aggregation.parse("sparse_mean"))
    assert combined["w"].tolist() == [4.5, 0.0, -4.0, 2.0]
    assert not Aggregation.parse("sparse_mean").screens
    assert NormHistory().verdict([1.0, 1e9], Aggregation.parse("sparse_mean")).scales == [1, 1]


def test_buffers_take_the_plain_mean_under_every_rule() -> None:
    gradients = [{"w": torch.tensor([1.0]), "count": torch.tensor(c)} for c in (0, 0, 9)]
    combined = aggregate(gradients, KINDS, Aggregation.parse("median"))
    assert combined["count"].item() == 3.0  # (0 + 0 + 9) / 3, not the median 0


def test_norm_is_l2_over_trainable_floats_only() -> None:
    gradient = {"w": torch.tensor([3.0, 4.0]), "count": torch.tensor(100)}
    assert update_norm(gradient, KINDS) == 5.0


def test_clipped_mean_scales_norms_above_the_multiple_of_the_median() -> None:
    history = NormHistory()
    aggregation = Aggregation.parse("clipped_mean", clip_multiple=1.0)
    screened = history.verdict([3.0, 4.0, 8.0], aggregation)
    # median 4, bound 1.0 x 4: the 8 is scaled by 4 / 8; 3 and 4 are kept whole
    assert screened.reference == 4.0 and screened.scales == [1.0, 1.0, 0.5]
    assert screened.refused == {}
    combined = aggregate(grads([3.0], [4.0], [8.0]), KINDS, aggregation, screened.scales)
    assert combined["w"].tolist() == [pytest.approx((3 + 4 + 4) / 3)]


def test_an_outlier_is_refused_with_its_reason_and_a_verdict_remembers_nothing() -> None:
    # (what a step used is remembered when it commits: tests/server/test_server_robust.py)
    history = NormHistory(norms=[1.0, 1.0])
    screened = history.verdict([1.0, 1.2, 50.0], Aggregation.parse("trimmed_mean:0.25"))
    # reference: median of 1, 1, 1, 1.2, 50 = 1; 50 > 10 x 1
    assert screened.scales == [1.0, 1.0, 0.0] and list(screened.refused) == [2]
    assert "more than 10x the median norm 1" in screened.refused[2]
    assert list(history.norms) == [1.0, 1.0]
    non_finite = history.verdict([1.0, math.nan], Aggregation.parse("median"))
    assert non_finite.scales == [1.0, 0.0]


def test_the_plain_mean_screens_nothing() -> None:
    screened = NormHistory().verdict([1.0, 1e9], Aggregation.parse("mean"))
    assert screened.scales == [1.0, 1.0] and screened.refused == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("average", "must be one of mean, clipped_mean, trimmed_mean:F, median, sparse_mean"),
        ("trimmed_mean", "trimmed_mean takes its trimmed fraction F"),
        ("trimmed_mean:x", "trimmed_mean takes its trimmed fraction F"),
        ("trimmed_mean:0.5", "the trimmed fraction F must be in [0, 0.5), got 0.5"),
        ("trimmed_mean:-0.1", "the trimmed fraction F must be in [0, 0.5)"),
        ("median:3", "aggregation median takes no argument"),
    ],
)
def test_bad_aggregations_name_the_problem(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        Aggregation.parse(text)
    assert says in str(raised.value)


def test_bad_clip_and_outlier_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="clip multiple must be > 0"):
        Aggregation.parse("clipped_mean", clip_multiple=0.0)
    with pytest.raises(ValueError, match="outlier ratio must be > 1"):
        Aggregation.parse("median", outlier_ratio=1.0)


def test_a_pseudo_gradient_pointing_away_from_the_median_is_refused() -> None:
    from diloco.algorithm.robust import opposed

    kinds = {"w": TensorKind.TRAINABLE, "b": TensorKind.FLOAT_BUFFER}
    rows = [[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [-1.5, -1.5]]
    gradients = [{"w": torch.tensor(r), "b": torch.tensor([-100.0])} for r in rows]
    # Per element, sorted: [-1.5, 1, 1, 2] twice; the median (mean of the middle two) is
    # (1, 1). The last row's cosine with it is -3 / (sqrt(4.5) sqrt(2)) = -1; the buffer,
    # which the outer optimizer does not train, is left out.
    assert opposed(gradients, kinds, [True] * 4) == {
        3: "pseudo-gradient points away from the round's median direction (cosine -1.000)"
    }
    assert opposed(gradients, kinds, [True, True, False, True]) == {
        # median of (1, 1, -1.5) and (1, 2, -1.5): (1, 1); still -1
        3: "pseudo-gradient points away from the round's median direction (cosine -1.000)"
    }
    assert opposed(gradients, kinds, [True, False, False, True]) == {}  # 2: median = mean


def test_a_scalar_tensor_counts_in_the_cosine_like_any_other() -> None:
    """A 0-dim trained tensor (a learned temperature, a logit scale) stacks to one dimension;
    it takes part as one element. By hand: per element the medians of (1, 1, 2, -1.5) and
    (1, 2, 1, -1.5) are (1, 1), the scalar's median of (1, 1, 1, -1) is 1; the last row
    (-1.5, -1.5, -1) has cosine -4 / (sqrt(5.5) sqrt(3)) = -0.985 with (1, 1, 1)."""
    from diloco.algorithm.robust import opposed

    kinds = {"w": TensorKind.TRAINABLE, "t": TensorKind.TRAINABLE}
    rows = [([1.0, 1.0], 1.0), ([1.0, 2.0], 1.0), ([2.0, 1.0], 1.0), ([-1.5, -1.5], -1.0)]
    gradients = [{"w": torch.tensor(w), "t": torch.tensor(t)} for w, t in rows]
    assert -4 / (math.sqrt(5.5) * math.sqrt(3)) == pytest.approx(-0.985, abs=5e-4)
    assert opposed(gradients, kinds, [True] * 4) == {
        3: "pseudo-gradient points away from the round's median direction (cosine -0.985)"
    }
