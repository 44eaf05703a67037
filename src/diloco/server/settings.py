"""The settings every worker must adopt; the server owns them and states them in /v1/info."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diloco.algorithm import APPLY_POLICIES, WEIGHTINGS, OuterOptimizer
from diloco.wire import dtype_name

SERVER_MODES = ("sync",)
DEFAULT_MAX_BODY_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class ServerSettings:
    """Validated on construction: a bad value fails with the field's name and allowed range."""

    mode: str = "sync"
    sync_every: int = 50
    outer_optimizer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float | None = None  # None: 0.9 for momentum/nesterov, 0 for sgd
    weighting: str = "uniform"
    policy: str = "default"
    upload_dtype: torch.dtype = torch.float32
    download_dtype: torch.dtype = torch.float32
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 30.0
    barrier_timeout: float = 600.0
    min_workers: int = 1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    dylu: bool = False
    # Server-side only (not sent to workers): how many tensor bodies may sit in RAM at once;
    # other uploads are written to `spool_dir` (the system temp dir if None) as they arrive.
    # 0 (the default) spools every submission: memory then stays ~4x the model for any K.
    memory_bodies: int = 0
    spool_dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in SERVER_MODES:
            raise ValueError(f"mode must be one of {', '.join(SERVER_MODES)}, got {self.mode!r}")
        for name in ("sync_every", "min_workers", "max_body_bytes", "fragments"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("heartbeat_interval", "heartbeat_timeout", "barrier_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.memory_bodies, int) or self.memory_bodies < 0:
            raise ValueError(
                f"memory_bodies must be an integer >= 0 (0: every upload goes to disk), "
                f"got {self.memory_bodies!r}"
            )
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                f"heartbeat_timeout ({self.heartbeat_timeout})"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if self.policy not in APPLY_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(APPLY_POLICIES)}, got {self.policy!r}"
            )
        for name in ("upload_dtype", "download_dtype"):
            if getattr(self, name) not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be float32 or bfloat16, got {getattr(self, name)}")
        self.make_outer_optimizer()  # raises for a bad kind, lr or momentum

    def make_outer_optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_optimizer, lr=self.outer_lr, momentum=self.outer_momentum)

    def to_wire(self) -> dict:
        """The `settings` object of /v1/info (docs/protocol.md)."""
        return {
            "sync_every": self.sync_every,
            "upload_dtype": dtype_name(self.upload_dtype),
            "download_dtype": dtype_name(self.download_dtype),
            "heartbeat_interval": float(self.heartbeat_interval),
            "heartbeat_timeout": float(self.heartbeat_timeout),
            "barrier_timeout": float(self.barrier_timeout),
            "fragments": self.fragments,
            "delay": self.delay,
            "alpha": self.alpha,
            "dylu": self.dylu,
            "weighting": self.weighting,
            "min_workers": self.min_workers,
            "max_body_bytes": self.max_body_bytes,
            "outer_optimizer": self.make_outer_optimizer().describe(),
        }
