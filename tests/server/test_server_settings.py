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
