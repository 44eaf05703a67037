"""ServerSettings: every mode's options checked on construction, naming the value and range."""

from __future__ import annotations

import pytest
import torch

from diloco.server.settings import ServerSettings

STREAMING = {"mode": "streaming", "sync_every": 10, "fragments": 2}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "bogus"}, "mode must be one of sync, streaming, async, got 'bogus'"),
        ({"fragments": 2}, "fragments applies to mode streaming only"),
        ({"alpha": 0.5}, "alpha applies to mode streaming only"),
        ({"mode": "async", "delay": 1}, "delay applies to mode streaming only"),
        ({"dylu": True}, "dylu applies to mode async only"),
        ({"mode": "streaming", "dn_period": 2}, "dn_period applies to mode async only"),
        (
            {**STREAMING, "sync_every": 50, "fragments": 3},
            "sync_every H must be divisible by fragments P, got H = 50, P = 3",
        ),
        ({**STREAMING, "fragments": 20}, "fragments P must be <= sync_every H"),
        ({**STREAMING, "delay": 5}, r"delay tau must be in \[0, S\) with S = H / P = 5, got 5"),
        ({**STREAMING, "delay": -1}, r"delay tau must be in \[0, S\)"),
        ({**STREAMING, "alpha": 1.5}, r"alpha must be in \[0, 1\], got 1.5"),
        ({**STREAMING, "alpha": -0.1}, r"alpha must be in \[0, 1\], got -0.1"),
        ({**STREAMING, "fragments": 0}, "fragments must be a positive integer, got 0"),
        ({"mode": "async", "barrier_timeout": 5.0}, "barrier_timeout does not apply"),
        ({"mode": "async", "min_workers": 2}, "min_workers does not apply to mode async"),
        ({"mode": "async", "outer_optimizer": "momentum"}, "outer_optimizer must be nesterov"),
        ({"mode": "async", "grace_seconds": -1.0}, "grace_seconds must be a number >= 0"),
        ({"mode": "async", "grace_seconds": float("inf")}, "grace_seconds must be a number"),
        ({"mode": "async", "staleness_weighting": "log"}, "must be one of none, inverse_sqrt"),
        ({"mode": "async", "dn_period": 0}, "dn_period must be a positive integer, got 0"),
        ({"mode": "async", "dn_c": 2.0}, "delayed nesterov c must be"),
        ({"barrier_timeout": 0.0}, "barrier_timeout must be a positive number of seconds"),
    ],
)
def test_a_bad_mode_setting_is_a_value_error_naming_it(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerSettings(**settings)


def test_each_mode_states_its_own_settings() -> None:
    streaming = ServerSettings(**STREAMING, delay=2, alpha=0.5).to_wire()
    assert (streaming["mode"], streaming["fragments"], streaming["delay"]) == ("streaming", 2, 2)
    assert streaming["alpha"] == 0.5 and streaming["barrier_timeout"] == 600.0
    asynchronous = ServerSettings(
        mode="async", dn_period=4, dn_c=0.1, grace_seconds=2, dylu=True
    ).to_wire()
    assert asynchronous["barrier_timeout"] is None and asynchronous["dylu"] is True
    assert asynchronous["grace_seconds"] == 2.0
    assert asynchronous["outer_optimizer"] == {
        "kind": "delayed_nesterov",
        "lr": 0.7,
        "momentum": 0.9,
        "delay": 4,
        "c": 0.1,
    }


def test_codec_settings_are_canonical_in_info_and_bf16_has_one_meaning():
    settings = ServerSettings(upload_codec=" TopK:0.03+INT2 ", codec_block=64, topk_chunk=256)
    wire = settings.to_wire()
    assert wire["upload_codec"] == "topk:0.03+int2"
    assert (wire["codec_block"], wire["topk_chunk"]) == (64, 256)
    assert wire["error_feedback_beta"] == 0.95 and wire["upload_dtype"] == "float32"
    assert settings.compressed_uploads and settings.upload.k == 8  # round(0.03 * 256) = 8
    # The older --upload-dtype bf16 and --upload-codec bf16 are one setting: plain bf16 bodies.
    for bf16 in (ServerSettings(upload_dtype=torch.bfloat16), ServerSettings(upload_codec="bf16")):
        assert bf16.to_wire()["upload_codec"] == "bf16"
        assert bf16.upload_dtype == torch.bfloat16 and not bf16.compressed_uploads
    assert not ServerSettings().compressed_uploads
    with pytest.raises(ValueError, match=r"error_feedback_beta must be in \[0, 1\)"):
        ServerSettings(error_feedback_beta=-0.1)
    with pytest.raises(ValueError, match="give one or the other"):
        ServerSettings(upload_codec="int4", upload_dtype=torch.bfloat16)


# ------------------------------------------------------------------ issue 30, item 1: the outer
# optimizer follows the upload codec where not given (algorithm/recipes.py)

TOPK = "topk:0.03+int2"
OPTIMIZER, LR, MOMENTUM = ALL_THREE = ("outer_optimizer", "outer_lr", "outer_momentum")
SPARSE = "aggregation"  # named in outer_defaults_from_codec where the codec picked sparse_mean
ALL_FOUR = (*ALL_THREE, SPARSE)


@pytest.mark.parametrize(
    ("given", "optimizer", "lr", "momentum", "aggregation", "from_codec"),
    [
        ({}, "nesterov", 0.7, 0.9, "mean", ALL_THREE),
        ({"upload_codec": "int8"}, "nesterov", 0.7, 0.9, "mean", ALL_THREE),
        ({"upload_codec": "bf16"}, "nesterov", 0.7, 0.9, "mean", ALL_THREE),
        ({"upload_codec": TOPK}, "sgd", 1.0, 0.0, "sparse_mean", ALL_FOUR),
        (
            {"upload_codec": "topk:0.1", "topk_chunk": 4096},
            "sgd",
            1.0,
            0.0,
            "sparse_mean",
            ALL_FOUR,
        ),
        # a value given is kept; the others still follow the codec
        (
            {"upload_codec": TOPK, "outer_lr": 0.5},
            "sgd",
            0.5,
            0.0,
            "sparse_mean",
            (OPTIMIZER, MOMENTUM, SPARSE),
        ),
        (
            {"upload_codec": TOPK, "outer_optimizer": "nesterov"},
            "nesterov",
            1.0,
            0.9,
            "sparse_mean",
            (LR, SPARSE),
        ),
        (
            {"upload_codec": TOPK, "outer_optimizer": "momentum", "outer_momentum": 0.5},
            "momentum",
            1.0,
            0.5,
            "sparse_mean",
            (LR, SPARSE),
        ),
        (
            {"upload_codec": TOPK, "outer_momentum": 0.0},
            "sgd",
            1.0,
            0.0,
            "sparse_mean",
            (OPTIMIZER, LR, SPARSE),
        ),
        ({"upload_codec": "int8", "outer_optimizer": "sgd"}, "sgd", 0.7, 0.0, "mean", (LR,)),
        (
            {"upload_codec": TOPK, "outer_optimizer": "sgd", "outer_lr": 1.0},
            "sgd",
            1.0,
            0.0,
            "sparse_mean",
            (SPARSE,),
        ),
        # the mean given is kept, and so is a robust rule
        ({"upload_codec": TOPK, "aggregation": "mean"}, "sgd", 1.0, 0.0, "mean", ALL_THREE),
        (
            {"upload_codec": TOPK, "aggregation": "clipped_mean"},
            "sgd",
            1.0,
            0.0,
            "clipped_mean",
            ALL_THREE,
        ),
        # token weighting: sparse_mean needs uniform weights, so the codec cannot pick it
        ({"upload_codec": TOPK, "weighting": "tokens"}, "sgd", 1.0, 0.0, "mean", ALL_THREE),
        # async steps with Delayed Nesterov and the mean whatever the codec: it chooses nothing
        ({"mode": "async", "upload_codec": TOPK}, "nesterov", 0.7, 0.9, "mean", ()),
        (
            {"mode": "streaming", "sync_every": 10, "fragments": 2, "upload_codec": TOPK},
            "sgd",
            1.0,
            0.0,
            "sparse_mean",
            ALL_FOUR,
        ),
    ],
)
def test_outer_settings_not_given_follow_the_upload_codec(
    given: dict, optimizer: str, lr: float, momentum: float, aggregation: str, from_codec: tuple
) -> None:
    settings = ServerSettings(**given)
    assert (settings.outer_optimizer, settings.outer_lr, settings.outer_momentum) == (
        optimizer,
        lr,
        momentum,
    )
    assert settings.aggregation == aggregation
    assert settings.outer_defaults_from_codec == from_codec
    wire = settings.to_wire()
    assert wire["outer_defaults_from_codec"] == list(from_codec)
    assert (wire["outer_optimizer"]["lr"], wire["outer_optimizer"]["momentum"]) == (lr, momentum)
    assert wire["aggregation"] == aggregation


def test_a_momentum_given_against_the_codec_s_sgd_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as refused:
        ServerSettings(upload_codec=TOPK, outer_momentum=0.9)
    assert str(refused.value) == (
        "outer_momentum 0.9 needs outer_optimizer momentum or nesterov: upload codec "
        "topk:0.03+int2 picks outer sgd, which has no momentum (SparseLoCo: the workers' error "
        "feedback stands in for it)"
    )
    with pytest.raises(ValueError, match="outer_optimizer must be nesterov, got 'sgd'"):
        ServerSettings(mode="async", upload_codec=TOPK, outer_optimizer="sgd")


def test_a_top_k_fraction_that_keeps_nothing_of_a_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keeps k = round\(0.0001 x 128\) = 0 values"):
        ServerSettings(upload_codec="topk:0.0001", topk_chunk=128)
    with pytest.raises(ValueError, match=r"round\(0.001 x 256\) = 0 values of each chunk of 256"):
        ServerSettings(download_codec="topk:0.001+int8", topk_chunk=256)
    with pytest.raises(ValueError, match=r"k = round\(1.5 x 128\) = 192 values, more than"):
        ServerSettings(upload_codec="topk:1.5")
    assert ServerSettings(upload_codec="topk:0.0001", topk_chunk=8192).upload.k == 1


def test_the_recipe_line_and_the_warnings_name_what_the_codec_chose() -> None:
    topk = ServerSettings(upload_codec=TOPK)
    assert topk.outer_recipe().startswith(
        "outer optimizer sgd lr 1 momentum 0, sparse_mean (optimizer, lr, momentum, aggregation "
        "chosen by upload codec topk:0.03+int2: SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706"
    )
    # at every default (sparse_mean, chunks of 128) top-k measured +5.2 % and +5.4 % at 137k
    (defaults,) = topk.outer_warnings()
    assert "ended +5.2 % at 137k parameters (H = 50, 100 outer steps) and +5.4 %" in defaults
    assert ServerSettings(upload_codec=TOPK, topk_chunk=4096).outer_warnings() == []  # +2.8 %
    (companion,) = ServerSettings(upload_codec=TOPK, aggregation="mean").outer_warnings()
    best = "+11.3 % to +12.2 % above the best fp32 DiLoCo run at H = 50 (+6.8 % at H = 10)"
    assert best in companion
    assert companion.endswith("the same runs ended +4.3 % at H = 50 and -0.8 % at H = 10")
    given = ServerSettings(upload_codec=TOPK, aggregation="sparse_mean").outer_warnings()
    assert given == [defaults]  # the same run, whether the codec or the user chose the rule
    momentum_too = ServerSettings(upload_codec=TOPK, aggregation="sparse_mean", outer_lr=1.0,
                                  outer_optimizer="nesterov").outer_warnings()  # fmt: skip
    assert len(momentum_too) == 1 and "+26.9 % to +39.0 %" in momentum_too[0]
    (momentum,) = ServerSettings(upload_codec=TOPK, outer_optimizer="nesterov").outer_warnings()
    assert "+26.9 % to +39.0 %" in momentum
    (asynchronous,) = ServerSettings(mode="async", upload_codec=TOPK).outer_warnings()
    assert asynchronous == momentum  # Delayed Nesterov: momentum 0.9, as measured
    assert ServerSettings(upload_codec="int8").outer_warnings() == []
    assert ServerSettings().outer_recipe() == (
        "outer optimizer nesterov lr 0.7 momentum 0.9, mean (optimizer, lr, momentum chosen by "
        "upload codec fp32: DiLoCo's outer Nesterov)"
    )
    given = ServerSettings(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    assert given.outer_recipe() == "outer optimizer nesterov lr 0.7 momentum 0.9, mean (given)"


def test_the_start_up_log_says_the_recipe_and_each_warning(caplog) -> None:
    from diloco.server.http.runner import log_outer_recipe

    with caplog.at_level("INFO", logger="diloco.server"):
        log_outer_recipe(ServerSettings(upload_codec=TOPK, outer_optimizer="nesterov"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        "INFO",
        ServerSettings(upload_codec=TOPK, outer_optimizer="nesterov").outer_recipe(),
    )
    assert lines[1] == (
        "INFO",
        "error feedback beta 0.95 (chosen by upload codec "
        "topk:0.03+int2: it keeps what the codec left out)",
    )
    assert [level for level, _ in lines] == ["INFO", "INFO", "WARNING"]
    assert "+26.9 % to +39.0 %" in lines[2][1]


def test_error_feedback_not_given_follows_the_upload_codec() -> None:
    """Off for bf16 and int8 (measured the same without it), 0.95 for the others; a beta given
    is kept; /v1/info and the start-up line say which."""
    for codec, beta in [
        ("int8", 0.0),
        ("bf16", 0.0),
        ("int4", 0.95),
        ("int2", 0.95),
        (TOPK, 0.95),
        ("topk:0.03+int8", 0.95),
        ("fp32", 0.95),
    ]:
        settings = ServerSettings(upload_codec=codec)
        assert (settings.error_feedback_beta, settings.error_feedback_from_codec) == (beta, True)
        wire = settings.to_wire()
        assert (wire["error_feedback_beta"], wire["error_feedback_from_codec"]) == (beta, True)
    # what a worker reads from /v1/info: the codec's beta, and that the codec chose it
    from diloco.server.coordinator import Coordinator
    from diloco.wire.schemas import InfoResponse
    from diloco.worker.settings import WorkerSettings

    info = Coordinator(ServerSettings(upload_codec="int8")).info()
    assert InfoResponse.model_validate(info).settings.error_feedback_from_codec is True
    assert WorkerSettings.from_info(info, "http://server").error_feedback_beta == 0.0
    given = ServerSettings(upload_codec="int8", error_feedback_beta=0.9)
    assert (given.error_feedback_beta, given.error_feedback_from_codec) == (0.9, False)
    assert given.feedback_recipe() == "error feedback beta 0.9 (given)"
    assert (
        ServerSettings(upload_codec="int8")
        .feedback_recipe()
        .startswith(
            "no error feedback (chosen by upload codec int8: the runs measured ended no worse "
            "without it, benchmarks/results/compression-int8-feedback/README.md"
        )
    )
    assert ServerSettings().feedback_recipe() is None  # fp32: nothing to feed back
    with pytest.raises(ValueError, match=r"error_feedback_beta must be in \[0, 1\)"):
        ServerSettings(upload_codec="int8", error_feedback_beta=1.0)


def test_a_restart_keeps_the_error_feedback_its_run_began_with_where_the_codec_chooses() -> None:
    # an int8 run begun when every codec's default was 0.95
    stored = ServerSettings(upload_codec="int8", error_feedback_beta=0.95).to_wire()
    del stored["error_feedback_from_codec"]
    settings = ServerSettings(upload_codec="int8")
    assert settings.keep_stored_outer(stored) == [
        "error_feedback_beta 0.95 (upload codec int8's default: 0.0)"
    ]
    assert (settings.error_feedback_beta, settings.error_feedback_from_codec) == (0.95, False)
    assert (
        settings.feedback_recipe() == "error feedback beta 0.95 (the state dir's run began with it)"
    )
    assert settings.keep_stored_outer(stored) == []  # said once
    # a run of another codec (changed with --override-settings): nothing is taken
    int4_run = {**stored, "upload_codec": "int4"}
    other = ServerSettings(upload_codec="int8")
    assert other.keep_stored_outer(int4_run) == [] and other.error_feedback_beta == 0.0
    # a beta given is kept, and one that agrees is still the codec's
    given = ServerSettings(upload_codec="int8", error_feedback_beta=0.5)
    assert given.keep_stored_outer(stored) == [] and given.error_feedback_beta == 0.5
    same = ServerSettings(upload_codec="int8")
    assert same.keep_stored_outer(same.to_wire()) == []
    assert same.error_feedback_from_codec
    # a stored value that is no beta is not taken (the settings check names the difference)
    for bad in (1.5, "0.9", None, True):
        odd = ServerSettings(upload_codec="int8")
        assert odd.keep_stored_outer({**stored, "error_feedback_beta": bad}) == []
        assert odd.error_feedback_beta == 0.0


def test_info_states_the_codec_s_choices_and_a_worker_reads_them() -> None:
    from diloco.server.coordinator import Coordinator
    from diloco.wire.schemas import InfoResponse
    from diloco.worker.settings import WorkerSettings

    info = Coordinator(ServerSettings(upload_codec=TOPK, outer_lr=0.5)).info()
    settings = info["settings"]
    chosen = ["outer_optimizer", "outer_momentum", "aggregation"]
    assert settings["outer_defaults_from_codec"] == chosen
    assert settings["outer_optimizer"] == {"kind": "sgd", "lr": 0.5, "momentum": 0.0}
    assert settings["aggregation"] == "sparse_mean"
    parsed = InfoResponse.model_validate(info)
    assert parsed.settings.outer_defaults_from_codec == chosen
    worker = WorkerSettings.from_info(info, "http://server")
    assert worker.outer_optimizer == {"kind": "sgd", "lr": 0.5, "momentum": 0.0}
    # a server from before the field: the schema's default
    older = {
        **info,
        "settings": {k: v for k, v in settings.items() if k != "outer_defaults_from_codec"},
    }
    assert InfoResponse.model_validate(older).settings.outer_defaults_from_codec == []


def test_a_restart_keeps_the_outer_settings_its_run_began_with_where_the_codec_chooses() -> None:
    # a top-k run begun before the codec chose sgd and sparse_mean: its stored settings say
    # nesterov 0.7 and the mean
    stored = ServerSettings(
        upload_codec=TOPK, outer_optimizer="nesterov", outer_lr=0.7, aggregation="mean"
    ).to_wire()
    del stored["outer_defaults_from_codec"]
    settings = ServerSettings(upload_codec=TOPK)
    assert settings.keep_stored_outer(stored) == [
        "outer_optimizer 'nesterov' (upload codec topk:0.03+int2's default: 'sgd')",
        "outer_lr 0.7 (upload codec topk:0.03+int2's default: 1.0)",
        "outer_momentum 0.9 (upload codec topk:0.03+int2's default: 0.0)",
        "aggregation 'mean' (upload codec topk:0.03+int2's default: 'sparse_mean')",
    ]
    assert (settings.outer_optimizer, settings.outer_lr, settings.outer_momentum) == (
        "nesterov",
        0.7,
        0.9,
    )
    assert settings.aggregation == "mean"
    assert settings.outer_defaults_from_codec == ()
    assert settings.to_wire()["outer_optimizer"] == stored["outer_optimizer"]
    # what was given is not touched, nor are settings that agree
    explicit = ServerSettings(
        upload_codec=TOPK, outer_optimizer="sgd", outer_lr=1.0, aggregation="sparse_mean"
    )
    assert explicit.keep_stored_outer(stored) == []
    assert explicit.outer_optimizer == "sgd"
    same = ServerSettings(upload_codec=TOPK)
    assert same.keep_stored_outer(same.to_wire()) == []
    assert same.outer_defaults_from_codec == ALL_FOUR
    lr_only = ServerSettings(upload_codec=TOPK, outer_optimizer="nesterov", aggregation="mean")
    assert lr_only.keep_stored_outer(stored) == [
        "outer_lr 0.7 (upload codec topk:0.03+int2's default: 1.0)"
    ]
    # a server from before aggregation was stored ran the mean
    sgd_run = ServerSettings(upload_codec=TOPK, aggregation="mean").to_wire()
    del sgd_run["aggregation"]
    older = ServerSettings(upload_codec=TOPK)
    assert older.keep_stored_outer(sgd_run) == [
        "aggregation 'mean' (upload codec topk:0.03+int2's default: 'sparse_mean')"
    ]
    assert (older.aggregation, older.outer_optimizer) == ("mean", "sgd")


def test_an_outer_lr_an_admin_set_is_no_longer_the_codec_s_choice() -> None:
    settings = ServerSettings(upload_codec=TOPK)
    settings.change_outer_lr(0.5)
    assert settings.outer_lr == 0.5
    assert settings.to_wire()["outer_defaults_from_codec"] == [OPTIMIZER, MOMENTUM, SPARSE]


def test_shards_do_not_compare_how_a_setting_was_chosen() -> None:
    from diloco.server.shards.peers import settings_difference

    defaults = ServerSettings().to_wire()
    given = ServerSettings(outer_optimizer="nesterov", outer_lr=0.7).to_wire()
    assert defaults["outer_defaults_from_codec"] != given["outer_defaults_from_codec"]
    assert settings_difference(defaults, given) is None
    assert settings_difference(defaults, ServerSettings(outer_lr=0.5).to_wire()) is not None


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_sparse_mean_with_a_codec_that_codes_small_values_as_zero_is_refused(codec: str) -> None:
    """A quantized 0 would count as not sent: refused in one line naming both; top-k (its
    default), the exact codecs and int2 (no zero level) take it."""
    with pytest.raises(ValueError) as refused:
        ServerSettings(upload_codec=codec, aggregation="sparse_mean")
    assert str(refused.value).startswith(
        f"aggregation sparse_mean counts an element as sent where its value is not 0, and "
        f"upload codec {codec} codes every small value as 0"
    )
    for fine in ("fp32", "bf16", "int2", TOPK):
        assert ServerSettings(upload_codec=fine, aggregation="sparse_mean").aggregation == (
            "sparse_mean"
        )


def test_top_k_with_int8_or_int4_values_averages_with_the_mean() -> None:
    """A kept value can fall on int8's or int4's zero level and would count as not sent, so
    those top-k codecs do not pick sparse_mean, and refuse it when given."""
    for codec in ("topk:0.03+int8", "topk:0.03+int4"):
        settings = ServerSettings(upload_codec=codec)
        assert settings.aggregation == "mean" and "aggregation" not in (
            settings.outer_defaults_from_codec
        )
        with pytest.raises(ValueError, match="codes its kept values' smallest as 0"):
            ServerSettings(upload_codec=codec, aggregation="sparse_mean")
    assert ServerSettings(upload_codec="topk:0.03").aggregation == "sparse_mean"  # fp32 values


@pytest.mark.parametrize("mode", ["sync", "async", "streaming"])
def test_a_shard_whose_codecs_differ_from_shard_0s_is_told_which(mode: str) -> None:
    """Issue 28's bad input: every mode takes every codec on shards, so a shard started with
    another codec, block, chunk or aggregation than shard 0's must be named at start (the
    line `diloco server` exits 2 with)."""
    from diloco.server.shards.peers import settings_difference

    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    base = {"mode": mode, "shard_urls": urls}
    if mode == "streaming":
        base.update(fragments=2, sync_every=4)
    leader = ServerSettings(**base, upload_codec="int8", download_codec="int8").to_wire()
    cases = [
        ({"upload_codec": "int4", "download_codec": "int8"}, "upload_codec is 'int4' here and "
         "'int8' on shard 0"),
        ({"upload_codec": "int8"}, "download_codec is 'fp32' here and 'int8' on shard 0"),
        ({"upload_codec": "int8", "download_codec": "int8", "codec_block": 64},
         "codec_block is 64 here"),
    ]  # fmt: skip
    for given, words in cases:
        mine = ServerSettings(**base, **given, shard=1).to_wire()
        assert words in (settings_difference(mine, leader) or ""), (given, words)
    same = ServerSettings(**base, upload_codec="int8", download_codec="int8", shard=1)
    assert settings_difference(same.to_wire(), leader) is None
