"""The shard layout, worked out by hand: tensors in name order, largest first to the shard
with the fewest fp32 bytes so far (ties: the earlier name, the lower shard)."""

from __future__ import annotations

import pytest
import torch

from diloco.wire import TensorSpec
from diloco.wire.format.shard_layout import master_bytes, shard_layout, split_by_layout


def spec(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec(name, tuple(shape), dtype, "trainable")


def test_master_bytes_count_floats_as_fp32_and_ints_as_themselves() -> None:
    assert master_bytes(spec("a", 3, 4)) == 48
    assert master_bytes(spec("h", 3, 4, dtype=torch.bfloat16)) == 48  # fp32 master
    assert master_bytes(spec("i", 5, dtype=torch.int64)) == 40
    assert master_bytes(spec("b", 7, dtype=torch.bool)) == 7
    assert master_bytes(spec("s")) == 4  # a scalar


def test_largest_first_to_the_lightest_shard() -> None:
    # bytes: emb 4000, w1 1600, w2 1600, b1 40, b2 40; name order: b1 b2 emb w1 w2
    specs = [spec("emb", 1000), spec("w1", 400), spec("b1", 10), spec("w2", 400), spec("b2", 10)]
    # emb -> 0 (4000); w1 -> 1 (1600); w2 -> 1 (3200); b1 -> 1 (3240); b2 -> 1 (3280)
    assert shard_layout(specs, 2) == [["emb"], ["w1", "b1", "w2", "b2"]]
    # 3 shards: emb -> 0; w1 -> 1; w2 -> 2; b1 -> 1 (1600 = 1600: the lower shard);
    # b2 -> 2 (shard 1 holds 1640 now, shard 2 1600)
    assert shard_layout(specs, 3) == [["emb"], ["w1", "b1"], ["w2", "b2"]]


def test_the_layout_does_not_depend_on_the_order_of_the_specs() -> None:
    specs = [spec("c", 8), spec("a", 8), spec("b", 8), spec("d", 2)]
    forward = shard_layout(specs, 2)
    backward = shard_layout(list(reversed(specs)), 2)
    assert [sorted(p) for p in forward] == [sorted(p) for p in backward]
    # equal sizes: a -> 0, b -> 1, c -> 0, d -> 1 (name order breaks the ties)
    assert [sorted(p) for p in forward] == [["a", "c"], ["b", "d"]]


def test_more_shards_than_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="shards must be at most the 2 units"):
        shard_layout([spec("a", 1), spec("b", 1)], 3)


def test_split_by_layout_names_what_does_not_fit() -> None:
    tensors = {"a": torch.zeros(2), "b": torch.ones(3)}
    parts = split_by_layout(tensors, [["a"], ["b"]])
    assert [list(p) for p in parts] == [["a"], ["b"]]
    assert parts[1]["b"].data_ptr() == tensors["b"].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="tensor 'c' is owned by no shard"):
        split_by_layout({**tensors, "c": torch.zeros(1)}, [["a"], ["b"]])
    with pytest.raises(ValueError, match="tensor 'b' of the layout is missing"):
        split_by_layout({"a": tensors["a"]}, [["a"], ["b"]])


def test_streaming_shards_own_whole_fragments_largest_first() -> None:
    """Fragments (in plan order) by fp32 bytes: f0 = a + b = 40 + 8 = 48, f1 = c = 64,
    f2 = d + e = 16 + 16 = 32. Largest first to the lightest shard: f1 -> 0 (64); f0 -> 1
    (48); f2 -> 1 (shard 1 holds 48 < 64: 80)."""
    from diloco.wire.format.shard_layout import fragment_shards, shard_fragment_plan

    specs = [spec("a", 10), spec("b", 2), spec("c", 16), spec("d", 4), spec("e", 4)]
    plan = [["a", "b"], ["c"], ["d", "e"]]
    assert fragment_shards(plan, specs, 2) == [1, 0, 1]
    assert shard_fragment_plan(plan, specs, 2, 0) == [[], ["c"], []]
    assert shard_fragment_plan(plan, specs, 2, 1) == [["a", "b"], [], ["d", "e"]]
    # 3 shards: one fragment each, f1 -> 0, f0 -> 1, f2 -> 2
    assert fragment_shards(plan, specs, 3) == [1, 0, 2]
    with pytest.raises(ValueError, match="at most the 3 units"):
        fragment_shards(plan, specs, 4)
