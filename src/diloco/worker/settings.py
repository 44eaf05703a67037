"""The server's settings as a worker adopts them: verbatim, and every required one present."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.algorithm.compression.codecs import Codec, parse_codec
from diloco.wire import torch_dtype

REQUIRED = (
    "sync_every",
    "upload_dtype",
    "download_dtype",
    "heartbeat_interval",
    "heartbeat_timeout",
    "fragments",
    "delay",
    "alpha",
    "dylu",
    "outer_optimizer",
)


class ServerSettingsError(RuntimeError):
    """The server did not state a setting the worker must adopt: a fatal misconfiguration."""


WORKER_MODES = ("sync", "streaming", "async")


@dataclass(frozen=True)
class WorkerSettings:
    mode: str
    sync_every: int
    upload_dtype: torch.dtype
    download_dtype: torch.dtype
    heartbeat_interval: float
    heartbeat_timeout: float
    fragments: int
    delay: int
    alpha: float
    dylu: bool
    outer_optimizer: dict
    weighting: str = "uniform"  # "tokens": the worker counts tokens if its loop reports none
    upload_codec: Codec = field(default_factory=Codec)  # how pseudo-gradients are coded
    download_codec: Codec = field(default_factory=Codec)  # not fp32: results may be deltas
    error_feedback_beta: float = 0.0  # e <- beta e + g before coding; 0: no error feedback

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                f"heartbeat_timeout ({self.heartbeat_timeout})"
            )
        if not 0 <= self.error_feedback_beta < 1:
            raise ValueError(
                f"error_feedback_beta must be in [0, 1), got {self.error_feedback_beta}"
            )

    @classmethod
    def from_info(cls, info: dict[str, Any], server: str) -> WorkerSettings:
        """Read /v1/info's settings; a missing or ill-typed one stops the worker with its name."""
        settings = info.get("settings")
        if not isinstance(settings, dict):
            raise ServerSettingsError(f"the server at {server} states no settings in /v1/info")
        missing = [name for name in REQUIRED if name not in settings]
        if missing:
            raise ServerSettingsError(
                f"the server at {server} does not state the required setting(s) "
                f"{', '.join(missing)}; a worker cannot choose them itself"
            )
        mode = info.get("mode")
        if mode not in WORKER_MODES:
            raise ServerSettingsError(
                f"the server at {server} runs mode {mode!r}; this worker supports "
                f"{', '.join(WORKER_MODES)}"
            )
        try:
            return cls(
                mode=mode,
                sync_every=int(settings["sync_every"]),
                upload_dtype=torch_dtype(settings["upload_dtype"]),
                download_dtype=torch_dtype(settings["download_dtype"]),
                heartbeat_interval=float(settings["heartbeat_interval"]),
                heartbeat_timeout=float(settings["heartbeat_timeout"]),
                fragments=int(settings["fragments"]),
                delay=int(settings["delay"]),
                alpha=float(settings["alpha"]),
                dylu=bool(settings["dylu"]),
                outer_optimizer=dict(settings["outer_optimizer"]),
                weighting=str(settings.get("weighting", "uniform")),
                upload_codec=parse_codec(
                    str(settings.get("upload_codec", "fp32")),
                    block=int(settings.get("codec_block", 128)),
                    chunk=int(settings.get("topk_chunk", 128)),
                ),
                download_codec=parse_codec(
                    str(settings.get("download_codec", "fp32")),
                    block=int(settings.get("codec_block", 128)),
                    chunk=int(settings.get("topk_chunk", 128)),
                ),
                error_feedback_beta=float(settings.get("error_feedback_beta", 0.0)),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and "heartbeat_interval" in str(exc):
                raise
            raise ServerSettingsError(
                f"the server at {server} states a bad setting: {exc}"
            ) from None

    def check_supported(self) -> None:
        """Settings this worker cannot follow are refused, not ignored."""
        if self.mode != "streaming" and self.fragments != 1:
            raise ServerSettingsError(
                f"the server states {self.fragments} fragments in mode {self.mode}; only "
                "streaming mode has more than one"
            )
