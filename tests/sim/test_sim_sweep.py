"""`--sweep` grids and side-by-side runs: values typed by hand, failures named, order kept."""

from __future__ import annotations

import math

import pytest

from diloco.sim import SimConfig, simulate
from diloco.sim.jobs import run_configs
from diloco.sim.sweep import MAX_RUNS, best_index, parse_sweeps
from sim.test_sim_modes import tiny

OPTIONS = {
    "mode": "diloco",
    "sync_every": 50,
    "outer_lr": 0.7,
    "outer_momentum": None,
    "error_feedback_beta": None,
    "dylu": False,
    "upload_codec": "fp32",
    "speeds": "",
    "model_config": None,
    "corpus": "shakespeare",
}


def test_one_axis_gives_one_run_per_value_typed_like_the_option() -> None:
    assert parse_sweeps(["outer-lr=0.5, 1"], OPTIONS) == [{"outer_lr": 0.5}, {"outer_lr": 1.0}]
    assert parse_sweeps(["sync_every=10,50"], OPTIONS) == [{"sync_every": 10}, {"sync_every": 50}]
    assert parse_sweeps(["outer-momentum=0.8"], OPTIONS) == [{"outer_momentum": 0.8}]
    # unset by default too (the upload codec picks it), and a number
    assert parse_sweeps(["error-feedback-beta=0,0.95"], OPTIONS) == [
        {"error_feedback_beta": 0.0},
        {"error_feedback_beta": 0.95},
    ]
    assert parse_sweeps(["dylu=true,no"], OPTIONS) == [{"dylu": True}, {"dylu": False}]
    assert parse_sweeps(["upload-codec=int8,topk:0.03+int2"], OPTIONS) == [
        {"upload_codec": "int8"},
        {"upload_codec": "topk:0.03+int2"},
    ]
    assert parse_sweeps([], OPTIONS) == [{}]
    # An option unset by default takes text, except the numeric ones (outer momentum)
    assert parse_sweeps(["model-config=a.json,b.json"], OPTIONS) == [
        {"model_config": "a.json"},
        {"model_config": "b.json"},
    ]


def test_two_axes_make_their_grid_with_the_first_axis_outermost() -> None:
    grid = parse_sweeps(["outer-lr=0.5,1.0", "sync-every=10,50,200"], OPTIONS)
    assert grid == [
        {"outer_lr": 0.5, "sync_every": 10},
        {"outer_lr": 0.5, "sync_every": 50},
        {"outer_lr": 0.5, "sync_every": 200},
        {"outer_lr": 1.0, "sync_every": 10},
        {"outer_lr": 1.0, "sync_every": 50},
        {"outer_lr": 1.0, "sync_every": 200},
    ]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["outer-lr"], "--sweep must look like KEY=V1,V2,..., got 'outer-lr'"),
        (["=1,2"], "--sweep must look like KEY=V1,V2,..., got '=1,2'"),
        (["bogus=1,2"], "--sweep 'bogus' is not a setting; sweepable: mode, sync-every, outer-lr"),
        (["speeds=1,2"], "--sweep 'speeds' is not a setting"),
        (["corpus=a,b"], "--sweep 'corpus' is not a setting"),
        (["outer-lr=0.5", "outer_lr=1"], "--sweep outer_lr is given twice"),
        (["outer-lr="], "--sweep outer-lr has no values"),
        (["outer-lr=0.5,x"], "--sweep outer-lr: 'x' is not a number"),
        (["sync-every=1.5"], "--sweep sync-every: '1.5' is not an integer"),
        (["dylu=maybe"], "--sweep dylu: 'maybe' is not true or false"),
        (["outer-lr=0.5,0.50,1"], "--sweep outer-lr lists 0.5 twice"),
        (
            [
                "sync-every=" + ",".join(map(str, range(1, 18))),
                "outer-lr=" + ",".join(str(0.1 * i) for i in range(1, 17)),
            ],
            f"--sweep makes 272 runs; at most {MAX_RUNS} in one command",
        ),
    ],
)
def test_bad_sweeps_are_named(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_sweeps(specs, OPTIONS)
    assert str(caught.value).startswith(message)


def test_the_best_run_is_the_lowest_loss_and_nan_never_wins() -> None:
    assert best_index([2.0, 1.5, 1.7]) == 1
    assert best_index([math.nan, 2.0, 2.0]) == 1
    assert best_index([math.nan]) == 0


def test_side_by_side_runs_equal_runs_in_this_process(small_corpus: bytes, tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(small_corpus)
    configs = [tiny(outer_lr=lr, corpus=str(corpus)) for lr in (0.5, 1.0)]
    seen: list[int] = []
    documents = run_configs(configs, jobs=2, progress=seen.append)
    # Each child trains its own settings, and the results come back in the order given.
    for config, document in zip(configs, documents, strict=True):
        alone = simulate(config, corpus=small_corpus)
        assert document["config"]["outer_lr"] == config.outer_lr
        assert document["final_eval_loss"] == pytest.approx(alone.final_eval_loss, rel=1e-4)
        assert document["outer_steps"] == alone.outer_steps == 2
    assert documents[0]["final_eval_loss"] != documents[1]["final_eval_loss"]
    assert sum(seen) == 2 * 2 * 8  # every inner step of both runs (K = 2, 8 steps)


def test_a_failing_child_is_named_and_raises(tmp_path) -> None:
    configs = [tiny(corpus=str(tmp_path / "gone.txt")), tiny(corpus=str(tmp_path / "gone.txt"))]
    with pytest.raises(RuntimeError, match="does not exist"):
        run_configs(configs, jobs=2)


def test_a_config_survives_its_json_round_trip() -> None:
    for config in (
        tiny(mode="async", speeds=(1.0, 0.5), dylu=True, upload_codec="int8"),
        tiny(mode="streaming", fragments=2, delay=1, alpha=0.5),
    ):
        assert SimConfig.from_dict(config.to_dict()) == config
    # A run without speeds keeps none (to_dict writes each worker's speed 1.0)
    plain = tiny()
    assert SimConfig.from_dict(plain.to_dict()).speeds == ()
