"""The shard layout, worked by hand with the longest-processing-time rule."""

from __future__ import annotations

import pytest

from diloco.algorithm.shards import assign_shards


def test_largest_first_to_the_lightest_shard() -> None:
    # 10 -> s0 (10); 7 -> s1 (7); 5 -> s1 (12); 4 -> s0 (14); 3 -> s1 (15); 1 -> s0 (15)
    assert assign_shards([10, 7, 5, 4, 3, 1], 2) == [[0, 3, 5], [1, 2, 4]]


def test_ties_go_to_the_earlier_unit_and_the_lower_shard() -> None:
    assert assign_shards([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]
    assert assign_shards([0, 0, 0], 3) == [[0], [1], [2]]


def test_one_shard_owns_everything_in_plan_order() -> None:
    assert assign_shards([3, 9, 1], 1) == [[0, 1, 2]]


def test_every_shard_owns_a_unit() -> None:
    # 100 -> s0; 3 -> s1 (s1, s2 both empty: the lower); 2 -> s2 (0 < 3); 1 -> s2 (2 < 3)
    assert assign_shards([100, 3, 2, 1], 3) == [[0], [1], [2, 3]]
    # 5 -> s0; 0 -> s1; the last 0 ties s1 (load 0) with s2 (load 0), and the lower shard
    # would win, but s2 is empty and only this unit is left: s2 takes it
    assert assign_shards([5, 0, 0], 3) == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("sizes", "shards", "message"),
    [
        ([1, 2], 0, "shards must be an integer >= 1, got 0"),
        ([1, 2], True, "shards must be an integer >= 1, got True"),
        ([1, 2], 3, "shards must be at most the 2 units of the model"),
        ([1, -2], 1, "unit 1 has a size of -2 bytes"),
        ([1.5], 1, "unit 0 has a size of 1.5 bytes"),
        ([], 1, "shards must be at most the 0 units"),
    ],
)
def test_bad_layouts_name_the_value(sizes, shards, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        assign_shards(sizes, shards)
