"""The simulator end to end on a tiny model: modes agree where the math says they must."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.sim import SimConfig, simulate
from tiny import TINY_MODEL


def tiny(**overrides) -> SimConfig:
    base = dict(
        workers=2,
        sync_every=4,
        steps=8,
        batch_size=4,
        seq_len=32,
        model=TINY_MODEL,
        warmup=2,
        eval_batches=2,
        seed=3,
    )
    base.update(overrides)
    return SimConfig(**base)


def test_diloco_k1_h1_outer_sgd_lr1_equals_plain_training(small_corpus: bytes) -> None:
    plain = simulate(tiny(mode="single", workers=1, steps=6), corpus=small_corpus)
    diloco = simulate(
        tiny(
            mode="diloco",
            workers=1,
            sync_every=1,
            steps=6,
            outer_optimizer="sgd",
            outer_lr=1.0,
            outer_momentum=0.0,
        ),
        corpus=small_corpus,
    )
    assert diloco.outer_steps == 6
    assert diloco.final_eval_loss == pytest.approx(plain.final_eval_loss, abs=1e-5)


def test_streaming_with_one_fragment_and_no_delay_equals_diloco(small_corpus: bytes) -> None:
    sync = simulate(tiny(mode="diloco"), corpus=small_corpus)
    streaming = simulate(
        tiny(mode="streaming", fragments=1, delay=0, alpha=0.0), corpus=small_corpus
    )
    assert [s for s, _ in streaming.eval_curve] == [s for s, _ in sync.eval_curve]
    for (_, a), (_, b) in zip(streaming.eval_curve, sync.eval_curve, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_diloco_bytes_are_one_model_per_round_each_way(small_corpus: bytes) -> None:
    result = simulate(tiny(mode="diloco", steps=10, sync_every=4), corpus=small_corpus)
    model_bytes = result.parameters * 4
    assert result.outer_steps == 3  # rounds end at 4, 8 and the partial round at 10
    assert result.bytes_sent_per_worker == 3 * model_bytes
    assert result.bytes_received_per_worker == 3 * model_bytes
    assert [s for s, _ in result.eval_curve] == [0, 4, 8, 10]


def test_ddp_bytes_are_a_ring_all_reduce_every_step(small_corpus: bytes) -> None:
    result = simulate(tiny(mode="ddp", workers=4, steps=5), corpus=small_corpus)
    model_bytes = result.parameters * 4
    assert result.bytes_sent_per_worker == pytest.approx(5 * 2 * 3 / 4 * model_bytes)
    assert result.outer_steps == 0


def test_streaming_peak_traffic_drops_with_fragments(small_corpus: bytes) -> None:
    whole = simulate(
        tiny(mode="streaming", fragments=1, sync_every=4, steps=8), corpus=small_corpus
    )
    split = simulate(
        tiny(mode="streaming", fragments=2, sync_every=4, delay=1, alpha=0.5, steps=8),
        corpus=small_corpus,
    )
    # Two fragments, each synced twice in 8 steps and once more at the end (alpha 0.5 leaves
    # local residue in every merge); one fragment at alpha 0, merged at step 8, needs none.
    assert (whole.outer_steps, split.outer_steps) == (2, 6)
    assert split.bytes_sent_per_worker == pytest.approx(1.5 * whole.bytes_sent_per_worker)
    assert split.peak_sync_bytes < 0.75 * whole.peak_sync_bytes
    assert math.isfinite(split.final_eval_loss)


def test_async_dylu_gives_slow_workers_fewer_local_steps(small_corpus: bytes) -> None:
    result = simulate(
        tiny(mode="async", workers=3, sync_every=4, steps=8, speeds=(1.0, 0.5, 0.25), dylu=True),
        corpus=small_corpus,
    )
    # Budgets are steps * v / max(v): 8, 4, 2 local steps; rounds of 4, 2, 1 steps.
    assert result.local_steps_per_worker == [8, 4, 2]
    assert result.outer_steps == 2 + 2 + 2
    assert result.eval_curve[-1][0] == 8
    assert math.isfinite(result.final_eval_loss)


def test_async_dylu_caps_the_reference_speed_at_16x_the_slowest_like_the_server(
    small_corpus: bytes,
) -> None:
    """Speeds 1 and 1/32, H = 32: uncapped, the slow worker would get floor(32 / 32) = 1 step
    a round; with the server's cap the reference is 16 / 32 = 0.5, so it gets
    floor((1/32) / 0.5 * 32) = 2, and its budget of int(64 / 32) = 2 steps is one arrival."""
    result = simulate(
        tiny(mode="async", workers=2, sync_every=32, steps=64, speeds=(1.0, 1 / 32), dylu=True),
        corpus=small_corpus,
    )
    assert result.local_steps_per_worker == [64, 2]
    assert [(w, n) for w, n, _ in result.arrivals if w == 1] == [(1, 2)]
    assert [(w, n) for w, n, _ in result.arrivals if w == 0] == [(0, 32), (0, 32)]


def test_async_with_a_grace_window_and_equal_speeds_is_sync_diloco(small_corpus: bytes) -> None:
    """Equal workers arrive together; the window makes each group one Nesterov step (N = 1),
    which is exactly a sync DiLoCo round."""
    sync = simulate(tiny(mode="diloco"), corpus=small_corpus)
    grace = simulate(tiny(mode="async", async_delay=1, grace=0.5), corpus=small_corpus)
    assert grace.outer_steps == sync.outer_steps == 2
    assert [(w, n) for w, n, _ in grace.arrivals] == [(0, 4), (1, 4), (0, 4), (1, 4)]
    for name, tensor in sync.final_state.items():
        torch.testing.assert_close(grace.final_state[name], tensor, rtol=1e-6, atol=1e-7)
    # Without the window the second arrival of each pair is stale and the runs part ways.
    apart = simulate(tiny(mode="async", async_delay=1), corpus=small_corpus)
    assert apart.outer_steps == 4
    assert abs(apart.final_eval_loss - sync.final_eval_loss) > 1e-4


def test_a_grace_window_waits_for_its_deadline_when_a_worker_is_still_training(
    small_corpus: bytes,
) -> None:
    """Speeds 1 and 0.5, H = 4: w0 arrives at t = 4 and w1 only at t = 8, past the 1-unit
    window, so w0's window closes alone at t = 5 and w0 starts its next window then."""
    result = simulate(
        tiny(mode="async", speeds=(1.0, 0.5), async_delay=1, grace=1.0), corpus=small_corpus
    )
    # w0: 4 steps from t = 0 (arrives 4, window closes 5), 4 more from 5 (arrives 9);
    # w1: its budget of 4 steps at speed 0.5 arrives at t = 8 and opens a window until 9,
    # which w0's arrival at 9 joins: two outer steps for three arrivals.
    assert result.arrivals == [(0, 4, 4.0), (1, 4, 8.0), (0, 4, 9.0)]
    assert result.outer_steps == 2


def test_inverse_sqrt_staleness_weighting_changes_only_stale_arrivals(
    small_corpus: bytes,
) -> None:
    with_window = dict(mode="async", async_delay=1, grace=0.5)  # nobody is ever stale
    plain = simulate(tiny(**with_window), corpus=small_corpus)
    weighted = simulate(
        tiny(**with_window, staleness_weighting="inverse_sqrt"), corpus=small_corpus
    )
    for name, tensor in plain.final_state.items():
        torch.testing.assert_close(weighted.final_state[name], tensor, rtol=0, atol=0)
    stale = dict(mode="async", async_delay=1)  # the second of each pair is 1 step stale
    plain = simulate(tiny(**stale), corpus=small_corpus)
    weighted = simulate(tiny(**stale, staleness_weighting="inverse_sqrt"), corpus=small_corpus)
    assert abs(plain.final_eval_loss - weighted.final_eval_loss) > 1e-5


def test_training_lowers_the_eval_loss(small_corpus: bytes) -> None:
    result = simulate(
        tiny(mode="diloco", steps=60, sync_every=10, batch_size=8, lr=1e-2, warmup=5),
        corpus=small_corpus,
    )
    initial = result.eval_curve[0][1]
    assert initial == pytest.approx(math.log(256), abs=0.1)
    assert result.final_eval_loss < initial - 1.0


def test_same_seed_same_result_and_json_fields(small_corpus: bytes) -> None:
    first = simulate(tiny(mode="diloco"), corpus=small_corpus).to_json()
    second = simulate(tiny(mode="diloco"), corpus=small_corpus).to_json()
    for key in (
        "mode",
        "workers",
        "sync_every",
        "steps",
        "final_eval_loss",
        "eval_curve",
        "outer_steps",
        "bytes_sent_per_worker",
        "bytes_received_per_worker",
        "wall_seconds",
    ):
        assert key in first
    assert first["eval_curve"] == second["eval_curve"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(mode="bogus"), "unknown mode"),
        (dict(workers=0), "workers must be a positive integer"),
        (dict(steps=0), "steps must be a positive integer"),
        (dict(sync_every=-1), "sync_every must be a positive integer"),
        (dict(seq_len=64), "seq_len"),
        (dict(mode="diloco", speeds=(1.0, 1.0)), "async"),
        (dict(mode="async", speeds=(1.0,)), "one value per worker"),
        (dict(mode="async", speeds=(1.0, 0.0)), "speeds must all be > 0"),
        (dict(mode="async", grace=-1.0), r"grace must be a number >= 0 \(simulated time\)"),
        (dict(mode="async", grace=math.inf), "grace must be a number >= 0"),
        (dict(mode="diloco", grace=1.0), "grace applies to --mode async only"),
        (
            dict(mode="async", staleness_weighting="log"),
            "staleness_weighting must be one of none, inverse_sqrt, got 'log'",
        ),
        (
            dict(mode="diloco", staleness_weighting="inverse_sqrt"),
            "staleness_weighting applies to --mode async only",
        ),
    ],
)
def test_bad_settings_raise_value_error_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(mode="diloco", outer_lr=0.0), "lr"),
        (dict(mode="diloco", outer_momentum=1.0), "momentum"),
        (dict(mode="streaming", fragments=3, sync_every=4), "fragments|divisible"),
        (dict(mode="streaming", fragments=2, sync_every=4, delay=2), "delay|tau"),
        (dict(mode="streaming", fragments=1, alpha=1.5), "alpha"),
    ],
)
def test_bad_algorithm_settings_fail_before_training(
    overrides: dict, message: str, small_corpus: bytes
) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(tiny(**overrides), corpus=small_corpus)
