"""Streaming DiLoCo: fragment plans, the send/merge schedule, and the alpha merge."""

import pytest
import torch

from diloco.algorithm import (
    StreamingSchedule,
    alpha_merge,
    block_prefixes_from_names,
    plan_fragments,
)

BLOCKS = [f"blocks.{i}." for i in range(4)]
MODEL = [
    ("embed.weight", 100),
    ("blocks.0.attn", 10),
    ("blocks.0.mlp", 20),
    ("blocks.1.attn", 10),
    ("blocks.1.mlp", 20),
    ("blocks.2.attn", 10),
    ("blocks.2.mlp", 20),
    ("blocks.3.attn", 10),
    ("blocks.3.mlp", 20),
    ("norm.weight", 5),
    ("head.weight", 100),
]


def _check_partition(plan: list[list[str]], model: list[tuple[str, int]]) -> None:
    order = {name: i for i, (name, _) in enumerate(model)}
    flat = [name for fragment in plan for name in fragment]
    assert sorted(flat) == sorted(order)
    for fragment in plan:
        assert fragment
        assert [order[n] for n in fragment] == sorted(order[n] for n in fragment)


# --- plan_fragments ------------------------------------------------------------------------


def test_blocks_are_strided_and_the_rest_goes_to_the_lightest_fragment() -> None:
    plan = plan_fragments(MODEL, 2, BLOCKS)
    _check_partition(plan, MODEL)
    # Blocks 0, 2 -> fragment 0 and 1, 3 -> fragment 1 (60 each). Then in model order: embed
    # (tie) -> 0 (160 vs 60), norm -> 1 (160 vs 65), head -> 1 (160 vs 165).
    assert plan == [
        ["embed.weight", "blocks.0.attn", "blocks.0.mlp", "blocks.2.attn", "blocks.2.mlp"],
        [
            "blocks.1.attn",
            "blocks.1.mlp",
            "blocks.3.attn",
            "blocks.3.mlp",
            "norm.weight",
            "head.weight",
        ],
    ]


def test_one_fragment_per_block() -> None:
    plan = plan_fragments(MODEL, 4, BLOCKS)
    _check_partition(plan, MODEL)
    assert plan[1] == ["blocks.1.attn", "blocks.1.mlp", "norm.weight"]


def test_longest_block_prefix_wins() -> None:
    model = [(f"blocks.{i}.w", 1) for i in range(12)]
    prefixes = [f"blocks.{i}" for i in range(12)]
    plan = plan_fragments(model, 12, prefixes)
    assert plan[10] == ["blocks.10.w"]
    assert plan[1] == ["blocks.1.w"]


def test_contiguous_split_without_blocks() -> None:
    model = [("a", 10), ("b", 10), ("c", 10), ("d", 10)]
    assert plan_fragments(model, 2) == [["a", "b"], ["c", "d"]]
    assert plan_fragments(model, 2, []) == [["a", "b"], ["c", "d"]]
    assert plan_fragments(model, 4) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_fragments([("big", 100), ("x", 1), ("y", 1), ("z", 1)], 2) == [
        ["big"],
        ["x", "y", "z"],
    ]


def test_contiguous_split_keeps_every_fragment_non_empty() -> None:
    model = [("a", 0), ("b", 0), ("c", 1000), ("d", 0)]
    plan = plan_fragments(model, 4)
    assert plan == [["a"], ["b"], ["c"], ["d"]]


def test_contiguous_split_is_balanced() -> None:
    model = [(f"t{i}", size) for i, size in enumerate([5, 7, 3, 9, 4, 6, 8, 2, 5, 1])]
    plan = plan_fragments(model, 3)
    _check_partition(plan, model)
    sizes = dict(model)
    loads = [sum(sizes[n] for n in fragment) for fragment in plan]
    assert max(loads) - min(loads) <= 9


@pytest.mark.parametrize(
    ("num_fragments", "prefixes", "message"),
    [
        (0, BLOCKS, r"fragments must be an integer >= 1"),
        (5, BLOCKS, r"fragments must be in \[1, 4\]"),
        (12, None, r"fragments must be in \[1, 11\]"),
    ],
)
def test_plan_rejects_bad_fragment_counts(
    num_fragments: int, prefixes: list[str] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_fragments(MODEL, num_fragments, prefixes)


def test_plan_rejects_a_block_without_tensors_and_duplicate_names() -> None:
    with pytest.raises(ValueError, match=r"blocks\.9\."):
        plan_fragments(MODEL, 2, [*BLOCKS, "blocks.9."])
    with pytest.raises(ValueError, match="'a'"):
        plan_fragments([("a", 1), ("a", 2)], 1)


# --- StreamingSchedule ---------------------------------------------------------------------


def test_reference_merges_every_window() -> None:
    schedule = StreamingSchedule(sync_every=600, num_fragments=3)
    assert schedule.window == 200
    merges = {t: schedule.fragments_merged_at(t) for t in range(1, 1801)}
    assert {t: f for t, f in merges.items() if f} == {
        200: [0],
        400: [1],
        600: [2],
        800: [0],
        1000: [1],
        1200: [2],
        1400: [0],
        1600: [1],
        1800: [2],
    }


def test_without_delay_a_fragment_is_sent_when_it_is_merged() -> None:
    schedule = StreamingSchedule(sync_every=600, num_fragments=3)
    for t in range(1, 1201):
        assert schedule.fragments_sent_at(t) == schedule.fragments_merged_at(t)


def test_delay_sends_tau_steps_before_the_merge() -> None:
    schedule = StreamingSchedule(sync_every=600, num_fragments=3, delay=5)
    sends = {t: f for t in range(1, 1201) if (f := schedule.fragments_sent_at(t))}
    assert sends == {195: [0], 395: [1], 595: [2], 795: [0], 995: [1], 1195: [2]}
    for t, (fragment,) in sends.items():
        merge_step = schedule.merge_step_for_send(fragment, t)
        assert merge_step == t + 5
        assert schedule.fragments_merged_at(merge_step) == [fragment]


def test_single_fragment_is_plain_diloco() -> None:
    schedule = StreamingSchedule(sync_every=4, num_fragments=1, delay=1)
    assert [t for t in range(1, 13) if schedule.fragments_merged_at(t)] == [4, 8, 12]
    assert [t for t in range(1, 13) if schedule.fragments_sent_at(t)] == [3, 7, 11]


def test_merge_step_for_send_rejects_a_step_that_is_not_a_send() -> None:
    schedule = StreamingSchedule(sync_every=600, num_fragments=3, delay=5)
    with pytest.raises(ValueError, match="not sent at step 200"):
        schedule.merge_step_for_send(0, 200)


def test_steps_are_counted_from_one() -> None:
    with pytest.raises(ValueError, match="step t must be an integer >= 1"):
        StreamingSchedule(sync_every=6, num_fragments=3).fragments_merged_at(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0, "num_fragments": 1}, r"sync_every H must be an integer >= 1"),
        ({"sync_every": 6, "num_fragments": 0}, r"fragments P must be an integer >= 1"),
        ({"sync_every": 2, "num_fragments": 3}, r"fragments P must be <= sync_every H"),
        ({"sync_every": 10, "num_fragments": 3}, r"sync_every H must be divisible by fragments P"),
        (
            {"sync_every": 600, "num_fragments": 3, "delay": 200},
            r"delay tau must be in \[0, S\) with S = H / P = 200, got 200",
        ),
        ({"sync_every": 600, "num_fragments": 3, "delay": -1}, r"delay tau must be in \[0, S\)"),
    ],
)
def test_invalid_schedule_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamingSchedule(**kwargs)


# --- alpha_merge ---------------------------------------------------------------------------


def test_alpha_merge_reference() -> None:
    merged = alpha_merge({"w": torch.tensor(0.601)}, {"w": torch.tensor(0.5)}, 0.5)
    assert float(merged["w"]) == pytest.approx(0.5505, abs=1e-6)


def test_alpha_merge_extremes_and_dtype() -> None:
    global_state = {"w": torch.tensor([1.0, 2.0])}
    local = {"w": torch.tensor([3.0, 5.0], dtype=torch.bfloat16), "other": torch.zeros(1)}
    assert torch.equal(alpha_merge(global_state, local, 0.0)["w"], global_state["w"].bfloat16())
    keep_local = alpha_merge(global_state, local, 1.0)
    assert torch.equal(keep_local["w"], local["w"])
    assert keep_local["w"].dtype == torch.bfloat16
    assert set(keep_local) == {"w"}


def test_alpha_merge_at_alpha_0_is_the_global_value_bit_for_bit() -> None:
    """(1 - 0) G' + 0 L in arithmetic would turn G' = -0.0 into +0.0 and a non-finite local
    value into NaN; alpha 0 takes G' as it is: -0.0 stays -0.0, 2.5 stays 2.5 beside a local
    inf or NaN."""
    global_state = {"w": torch.tensor([-0.0, 2.5, 2.5])}
    local = {"w": torch.tensor([1.0, float("inf"), float("nan")])}
    merged = alpha_merge(global_state, local, 0.0)["w"]
    assert merged.tolist() == [0.0, 2.5, 2.5]
    assert torch.signbit(merged).tolist() == [True, False, False]


def test_alpha_merge_rounds_int_buffers_half_to_even_and_thresholds_bools() -> None:
    """The buffer policy, applied to the mix: (1 - a) G' + a L, by hand. Ints: 0.5 * 10 +
    0.5 * 13 = 11.5 -> 12 (truncation gave 11), 0.5 * 10 + 0.5 * 11 = 10.5 -> 10 (even),
    0.75 * 2 + 0.25 * 9 = 3.75 -> 4, and 2**40 + 1 against 2**40 + 3 -> 2**40 + 2 (exact past
    fp32). Bools: True when the mix is >= 0.5: False/True at a = 0.25 -> 0.25 -> False (any
    nonzero gave True), at a = 0.5 -> True; True/False at a = 0.75 -> 0.25 -> False."""
    big = 2**40
    half = alpha_merge(
        {"n": torch.tensor([10, 10], dtype=torch.int32), "big": torch.tensor(big + 1)},
        {"n": torch.tensor([13, 11], dtype=torch.int32), "big": torch.tensor(big + 3)},
        0.5,
    )
    assert half["n"].dtype == torch.int32 and half["n"].tolist() == [12, 10]
    assert half["big"].dtype == torch.int64 and int(half["big"]) == big + 2
    quarter = alpha_merge({"n": torch.tensor(2)}, {"n": torch.tensor(9)}, 0.25)
    assert int(quarter["n"]) == 4
    flags_global = {"b": torch.tensor([False, True])}
    flags_local = {"b": torch.tensor([True, False])}
    assert alpha_merge(flags_global, flags_local, 0.25)["b"].tolist() == [False, True]
    assert alpha_merge(flags_global, flags_local, 0.5)["b"].tolist() == [True, True]
    assert alpha_merge(flags_global, flags_local, 0.75)["b"].tolist() == [True, False]
    assert alpha_merge(flags_global, flags_local, 0.75)["b"].dtype == torch.bool


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_out_of_range(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got"):
        alpha_merge({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, alpha)


def test_alpha_merge_name_and_shape_errors() -> None:
    with pytest.raises(ValueError, match="'w'"):
        alpha_merge({"w": torch.zeros(1)}, {}, 0.5)
    with pytest.raises(ValueError, match="'w'"):
        alpha_merge({"w": torch.zeros(1)}, {"w": torch.zeros(2)}, 0.5)


# --- block_prefixes_from_names -----------------------------------------------------------


def test_block_prefixes_from_names_equal_those_from_the_module() -> None:
    from diloco.models import GPT, GPTConfig, block_prefixes

    model = GPT(GPTConfig(context=8, width=8, depth=3, heads=2))
    assert block_prefixes_from_names(list(model.state_dict())) == block_prefixes(model)
    assert block_prefixes_from_names([n for n, _ in MODEL]) == BLOCKS


@pytest.mark.parametrize(
    ("names", "prefixes"),
    [
        (
            ["transformer.h.0.w", "transformer.h.1.w", "lm_head.w"],
            ["transformer.h.0.", "transformer.h.1."],
        ),
        (
            ["model.layers.0.q", "model.layers.1.q", "model.norm"],
            ["model.layers.0.", "model.layers.1."],
        ),
        (["blocks.0.w", "blocks.2.w"], []),  # a gap: not a run of blocks 0..n-1
        (["blocks.00.w", "blocks.1.w"], []),  # a leading zero is not an index
        (["blocks.w", "head.w"], []),  # no index at all
        (["embed.w", "head.w"], []),
    ],
)
def test_block_prefixes_from_names_read_only_complete_numbered_blocks(
    names: list[str], prefixes: list[str]
) -> None:
    assert block_prefixes_from_names(names) == prefixes
